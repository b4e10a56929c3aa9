"""The reference-engine fleet the Ray-driven synchronizer tests share: its shapes, the
synchronizer the factory builds over it, and a bounded wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from refit_core import RefitError, create_weight_synchronizer
from refit_core.backend import CollectiveSenderSpec
from refit_lab.ray_cluster import LocalCluster
from refit_lab.reference_engine import ReferenceModelConfig
from refit_nccl import CollectiveWeightSynchronizer

MiB = 1024 * 1024
CONFIG = ReferenceModelConfig(vocab_size=512, hidden_size=128, num_layers=3, intermediate_size=384)
GEOMETRY = CollectiveSenderSpec("refit", MiB, 2)
PROMPTS = [[1, 2, 3], [7, 7, 7, 7]]


def make_synchronizer(
    policy: object, fleet: Any, timeout_s: float = 30.0, buffer_gb: float | None = None
) -> CollectiveWeightSynchronizer:
    synchronizer = create_weight_synchronizer(
        policy,
        fleet,
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(len(fleet.workers)),
        refit_buffer_size_gb=buffer_gb,
        refit_timeout_s=timeout_s,
    )
    assert isinstance(synchronizer, CollectiveWeightSynchronizer)
    return synchronizer


def wait_for(predicate: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    give_up = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < give_up, f"gave up waiting for {what}"
        time.sleep(0.02)


def failing_in_thread(call: Callable[[], object]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``call`` on a thread; the dict gets its RefitError (``error``) and when it was
    raised (``at``, monotonic)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            call()
        except RefitError as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome
