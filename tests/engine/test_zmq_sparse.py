"""refit-zmq's sparse relay receiver inside a real vLLM engine: deltas applied to the
worker's checkpoint-format shadow, pushed through layerwise reload on commit, and a transfer
that fails part-way rolled back without the engine ever seeing it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import CheckpointPolicy, Checkpoints, Outputs, generate

from refit_core import RefitError, WeightSynchronizer, create_weight_synchronizer
from refit_lab.ray_cluster import LocalCluster
from refit_lab.zmq_faults import CorruptingRelayProxy

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUCKET_GB = 32 / 1024 / 1024  # 32 KiB of dense input per payload: a dozen payloads per refit


class _CorruptNth(CorruptingRelayProxy):
    """Corrupts the ``nth`` DATA chunk forwarded after :meth:`corrupt_chunk`."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.remaining: int | None = None

    def corrupt_chunk(self, nth: int) -> None:
        self.remaining = nth

    def _maybe_corrupt(self, frames: list[bytes]) -> list[bytes]:
        if self.remaining is not None and len(frames) == 3 and frames[2]:
            self.remaining -= 1
            if self.remaining == 0:
                self.remaining = None
                self.arm()
        return super()._maybe_corrupt(frames)


class _Routed:
    """The generation, with its relay reached through a proxy."""

    def __init__(self, generation: Any, proxy: CorruptingRelayProxy) -> None:
        self._generation = generation
        self._proxy = proxy

    def relay_addresses(self) -> list[str]:
        return [self._proxy.address]

    def refit_committed(self, version: int) -> None:
        self._generation.refit_committed(version)


@pytest.fixture(scope="module")
def policy(checkpoints: Checkpoints) -> CheckpointPolicy:
    return CheckpointPolicy(checkpoints, "A")


@pytest.fixture(scope="module")
def generation(sparse_engine: tuple[Any, Outputs]) -> Any:
    from refit_zmq.vllm import VllmRelayGeneration

    llm, _ = sparse_engine
    return VllmRelayGeneration([llm], relay_timeout_s=20.0)


@pytest.fixture(scope="module")
def proxy(generation: Any) -> Iterator[_CorruptNth]:
    (address,) = generation.relay_addresses()
    proxy = _CorruptNth(address)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def synchronizer(
    generation: Any, proxy: _CorruptNth, policy: CheckpointPolicy
) -> Iterator[WeightSynchronizer]:
    with create_weight_synchronizer(
        policy,
        _Routed(generation, proxy),
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_buffer_size_gb=BUCKET_GB,
        refit_timeout_s=120.0,
        transport="zmq_sparse",
    ) as synchronizer:
        yield synchronizer


def test_refit_a_to_b_equals_a_fresh_engine_on_b(
    sparse_engine: tuple[Any, Outputs],
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    fresh: dict[str, Outputs],
) -> None:
    llm, _ = sparse_engine
    generate(llm, expect_cached=True)  # B prefixes are cached now
    policy.state = "A"
    synchronizer.sync_weights()  # the first refit: a dense resync
    assert generate(llm, expect_cached=False) != fresh["B"]
    policy.state = "B"
    result = synchronizer.sync_weights()
    assert generate(llm, expect_cached=False) == fresh["B"]
    assert llm.llm_engine.get_weight_version() == str(result.version)


def test_sparse_refit_b_to_b_prime_equals_a_fresh_engine_on_b_prime(
    sparse_engine: tuple[Any, Outputs],
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    fresh: dict[str, Outputs],
) -> None:
    llm, _ = sparse_engine
    policy.state = "B'"
    result = synchronizer.sync_weights()
    assert result.changed_elements is not None
    assert 0 < result.changed_elements < 0.03 * result.dense_bytes / 2
    assert result.wire_bytes < result.dense_bytes / 4, "a 1% change travels sparse"
    assert generate(llm, expect_cached=False) == fresh["B'"]


def test_refit_corrupted_mid_way_leaves_the_previous_version(
    sparse_engine: tuple[Any, Outputs],
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    proxy: _CorruptNth,
    fresh: dict[str, Outputs],
) -> None:
    llm, _ = sparse_engine
    served = llm.llm_engine.get_weight_version()
    policy.state = "B''"
    proxy.corrupt_chunk(3)  # earlier payloads apply to the shadow, a later one is corrupted
    with pytest.raises(RefitError, match="checksum"):
        synchronizer.sync_weights()
    assert proxy.corrupted == 1
    assert generate(llm) == fresh["B'"], "exactly the previous version"
    assert llm.llm_engine.get_weight_version() == served

    result = synchronizer.sync_weights()  # the same refit again, uncorrupted
    assert result.ok
    assert generate(llm, expect_cached=False) != fresh["B'"]
