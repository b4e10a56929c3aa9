"""refit-zmq's colocated IPC channel into a real vLLM engine on this host: shared-memory
buffers, the receiver serving inside vLLM's update session, through the factory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import CheckpointPolicy, Checkpoints, Outputs, generate

from refit_core import GeometryMismatchError, WeightSynchronizer, create_weight_synchronizer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUFFER_GB = 64 / 1024 / 1024  # 64 KiB buffers: many buckets, and one-off buffers for embeddings


@pytest.fixture(scope="module")
def generation(ipc_engine: tuple[Any, Outputs]) -> Iterator[Any]:
    from refit_zmq.vllm import VllmIpcGeneration

    llm, _ = ipc_engine
    generation = VllmIpcGeneration([llm])
    try:
        yield generation
    finally:
        generation.close()


def _synchronizer(policy: CheckpointPolicy, generation: Any) -> WeightSynchronizer:
    return create_weight_synchronizer(
        policy, generation, "vllm", True, refit_buffer_size_gb=BUFFER_GB, refit_timeout_s=120.0
    )


def test_refits_a_to_b_to_b_prime_equal_fresh_engines(
    ipc_engine: tuple[Any, Outputs],
    generation: Any,
    checkpoints: Checkpoints,
    fresh: dict[str, Outputs],
) -> None:
    llm, on_a = ipc_engine
    assert on_a != fresh["B"]
    generate(llm, expect_cached=True)  # A prefixes are cached now
    policy = CheckpointPolicy(checkpoints, "B")
    with _synchronizer(policy, generation) as synchronizer:
        result = synchronizer.sync_weights()
        assert result.ok
        assert generate(llm, expect_cached=False) == fresh["B"]
        assert llm.llm_engine.get_weight_version() == str(result.version)
        policy.state = "B'"
        synchronizer.sync_weights()
        assert generate(llm, expect_cached=False) == fresh["B'"]


def test_state_that_does_not_fit_the_engine_is_refused_before_any_byte(
    ipc_engine: tuple[Any, Outputs],
    generation: Any,
    checkpoints: Checkpoints,
    fresh: dict[str, Outputs],
) -> None:
    llm, _ = ipc_engine
    checkpoints.tensors["wrong"] = {
        name: tensor[:1] if name == "lm_head.weight" else tensor
        for name, tensor in checkpoints.tensors["B"].items()
    }
    served = llm.llm_engine.get_weight_version()
    with (
        _synchronizer(CheckpointPolicy(checkpoints, "wrong"), generation) as synchronizer,
        pytest.raises(GeometryMismatchError, match=r"lm_head\.weight"),
    ):
        synchronizer.sync_weights(version=int(served) + 1)
    assert generate(llm) == fresh["B'"], "the engine still serves what it had"
    assert llm.llm_engine.get_weight_version() == served
