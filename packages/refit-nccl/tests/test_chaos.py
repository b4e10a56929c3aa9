"""Chaos on the collective row: refits with random engine kills and freezes mid-transfer.

Every refit either commits on every live engine or fails with a structured error within its
deadline (plus settling); ``recover()`` always brings the live engines to one version; and
no engine ever serves a version it did not report: a serving engine holds exactly the bits
of the version it reports, and a closed one generates nothing. The faults come from a seeded
generator (``REFIT_CHAOS_SEED``), so a failing run can be replayed.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from refit_core import EngineHealth, Recovery, RefitError, create_weight_synchronizer
from refit_core.backend import CollectiveSenderSpec
from refit_lab.digest import state_digest
from refit_lab.faults import freeze, kill, thaw
from refit_lab.ray_cluster import LocalCluster, local_ray
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl import CollectiveOptions

pytest.importorskip("ray", reason="ray (dev group) is not installed")

MiB = 1024 * 1024
CONFIG = ReferenceModelConfig(vocab_size=512, hidden_size=128, num_layers=3, intermediate_size=384)
GEOMETRY = CollectiveSenderSpec("refit", MiB, 2)
ROUNDS = 30
DEADLINE_S = 3.0
SEED = int(os.environ.get("REFIT_CHAOS_SEED", "2026"))
_OPTIONS = CollectiveOptions()
RELEASED_S = DEADLINE_S + _OPTIONS.grace_s + 2 * _OPTIONS.settle_s + 1.0
"""The latest a failed refit may end: the deadline, the grace for participants to report
their own timeouts, the settle for the rest and for the engines' states, and a second."""


@pytest.fixture(scope="module")
def fleet() -> Iterator[Any]:
    import ray_actors

    options = {"object_store_memory": 80 * MiB, "log_to_driver": False}
    with local_ray(num_cpus=4, by_value=[ray_actors], **options):
        created = ray_actors.Fleet(CONFIG, GEOMETRY, shards=3)
        try:
            yield created
        finally:
            created.close()


def _when(predicate: Callable[[], bool], within_s: float = 30.0) -> bool:
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _refit_in_background(synchronizer: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``sync_weights`` on a thread; its outcome (result or error, elapsed) fills the dict."""
    outcome: dict[str, Any] = {}

    def refit() -> None:
        started = time.monotonic()
        try:
            outcome["result"] = synchronizer.sync_weights()
        except RefitError as exc:
            outcome["error"] = exc
        outcome["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=refit)
    thread.start()
    return thread, outcome


def _wait_until_loading(victim: Any, refit: threading.Thread) -> None:
    """Until ``victim`` has started loading the refit (its weights are changing)."""
    import ray

    assert _when(
        lambda: (
            bool(ray.get(victim.refit_status.remote(), timeout=30).closed) or not refit.is_alive()
        )
    ), "the victim never started loading"


def _check_served_versions(
    fleet: Any, synchronizer: Any, digests: dict[int, dict[str, int]]
) -> None:
    """No engine serves a version it did not report."""
    import ray

    for engine in synchronizer.status().engines:
        worker = fleet.workers[engine.shard]
        if engine.health is EngineHealth.SERVING and engine.version in digests:
            held = ray.get(worker.state_digests.remote(), timeout=60)
            assert held == digests[engine.version], (
                f"{engine.worker} reports version {engine.version} but holds other bits"
            )
        elif engine.health is EngineHealth.CLOSED:
            with pytest.raises(ray.exceptions.RayTaskError, match="EngineClosedError"):
                ray.get(worker.generate.remote([[1, 2, 3]], 2), timeout=60)


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_refits_under_random_kills_and_freezes(fleet: Any) -> None:
    import ray

    rng = random.Random(SEED)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 11), lr=1e-2)
    synchronizer = create_weight_synchronizer(
        trainer,
        fleet,
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(3),
        refit_timeout_s=DEADLINE_S,
    )
    digests: dict[int, dict[str, int]] = {}
    faults = {"kill": 0, "freeze": 0, "none": 0}
    try:
        for round_ in range(ROUNDS):
            trainer.step()
            target = synchronizer.version + 1
            digests[target] = state_digest(trainer.engine_state().items())
            fault = rng.choice(["none", "none", "kill", "freeze"])
            faults[fault] += 1
            shard = rng.randrange(3)
            victim_pid = ray.get(fleet.workers[shard].pid.remote(), timeout=60)
            fleet.call("set_load_delay", 0.3 if fault != "none" else 0.0)
            thread, outcome = _refit_in_background(synchronizer)
            if fault != "none":
                _wait_until_loading(fleet.workers[shard], thread)
                (kill if fault == "kill" else freeze)(victim_pid)
            thread.join(DEADLINE_S + 30)
            assert not thread.is_alive(), f"round {round_}: the refit hung"
            if fault == "freeze":
                thaw(victim_pid)
            if "result" in outcome:
                versions = fleet.call("weight_version")
                assert versions == [target] * 3, f"round {round_}: committed {versions}"
            else:
                error: RefitError = outcome["error"]
                assert fault != "none", f"round {round_}: unprovoked failure: {error}"
                assert outcome["elapsed_s"] <= RELEASED_S, (
                    f"round {round_}: the error took {outcome['elapsed_s']:.1f} s"
                )
                assert error.recovery is Recovery.RECOVER and error.engines
                assert str(error).startswith(f"refit to version {target} failed")
                if fault == "kill":
                    fleet.restart(shard, seed=1000 + round_)
                fleet.call("set_load_delay", 0.0)
                report = synchronizer.recover()
                assert report.after.consistent, f"round {round_}: {report.after.describe()}"
            fleet.call("set_load_delay", 0.0)
            _check_served_versions(fleet, synchronizer, digests)
        assert faults["kill"] and faults["freeze"], f"the seed drew no variety: {faults}"
    finally:
        synchronizer.shutdown()
