"""refit-nccl's packed collective into a real vLLM engine: the synchronizer's trainer rank in
this process, the receiver inside the engine's worker, through the factory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import CheckpointPolicy, Checkpoints, Outputs, generate

from refit_core import GeometryMismatchError, WeightSynchronizer, create_weight_synchronizer
from refit_lab.ray_cluster import LocalCluster

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def policy(checkpoints: Checkpoints) -> CheckpointPolicy:
    return CheckpointPolicy(checkpoints, "A")


@pytest.fixture(scope="module")
def synchronizer(
    collective_engine: tuple[Any, Outputs], policy: CheckpointPolicy
) -> Iterator[WeightSynchronizer]:
    from refit_nccl.vllm import VllmCollectiveGeneration

    llm, _ = collective_engine
    with create_weight_synchronizer(
        policy,
        VllmCollectiveGeneration([llm]),
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_timeout_s=120.0,
    ) as synchronizer:
        yield synchronizer


def _refit(synchronizer: WeightSynchronizer, policy: CheckpointPolicy, state: str) -> int:
    policy.state = state
    result = synchronizer.sync_weights()
    assert result.ok and result.dense_bytes > 0
    return result.version


def test_refit_a_to_b_equals_a_fresh_engine_on_b(
    collective_engine: tuple[Any, Outputs],
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    fresh: dict[str, Outputs],
) -> None:
    llm, _ = collective_engine
    generate(llm, expect_cached=True)  # B' prefixes are cached now
    _refit(synchronizer, policy, "A")
    on_a = generate(llm, expect_cached=False)  # the commit reset the prefix cache
    assert on_a != fresh["B"]
    version = _refit(synchronizer, policy, "B")
    assert generate(llm, expect_cached=False) == fresh["B"]
    assert llm.llm_engine.get_weight_version() == str(version)


def test_sparse_change_b_to_b_prime_equals_a_fresh_engine_on_b_prime(
    collective_engine: tuple[Any, Outputs],
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    fresh: dict[str, Outputs],
) -> None:
    llm, _ = collective_engine
    assert fresh["B'"] != fresh["B"], "the 1% change must show in the logprobs"
    _refit(synchronizer, policy, "B'")
    assert generate(llm, expect_cached=False) == fresh["B'"]


def test_state_that_does_not_fit_the_engine_is_refused_before_any_byte(
    collective_engine: tuple[Any, Outputs], checkpoints: Checkpoints, fresh: dict[str, Outputs]
) -> None:
    from refit_nccl.vllm import VllmCollectiveGeneration

    llm, _ = collective_engine
    checkpoints.tensors["wrong"] = {
        name: tensor[:1] if name == "lm_head.weight" else tensor
        for name, tensor in checkpoints.tensors["A"].items()
    }
    with (
        create_weight_synchronizer(
            CheckpointPolicy(checkpoints, "wrong"),
            VllmCollectiveGeneration([llm]),
            "vllm",
            False,
            train_cluster=LocalCluster(1),
            inference_cluster=LocalCluster(1),
            refit_timeout_s=60.0,
        ) as synchronizer,
        pytest.raises(GeometryMismatchError, match=r"lm_head\.weight"),
    ):
        synchronizer.sync_weights()
    assert generate(llm) == fresh["B'"], "the engine still serves what it had"
