"""refit-zmq's sparse relay receiver inside real vLLM engines (tensor-parallel 1 and 2): a relay
in every worker staging deltas; after the commit, the engine closed while the deltas are
written in place (runtime parameters the write map reaches) and into the shadow (modules vLLM's
CPU backend repacked, then reloaded); a transfer that fails part-way (producer killed or frozen
mid-stream, a payload corrupted on the wire) never reaches the model, so the engine serves
exactly its previous weights, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from child_trainer import ChildParticipant, sparse_producer
from dense_checks import closed_until_a_refit
from engine_helpers import (
    SPARSE_BUCKET_GB,
    CheckpointPolicy,
    Checkpoints,
    Engine,
    FreshOutputs,
    generate,
    running_engine,
    sparse_synchronizer,
)
from stale_kernel import failed_verification, stale_kernel
from timing_checks import timings_add_up

from refit_core import RefitError, WeightSynchronizer
from refit_lab.digest import state_digest
from refit_lab.zmq_faults import CorruptingRelayProxy, ProxiedRelays

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

DEADLINE_S = 10.0


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


@pytest.fixture(scope="module")
def checkpoints(tied_checkpoints: Checkpoints) -> Checkpoints:
    """The module refits a model with tied embeddings."""
    return tied_checkpoints


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(
    request: pytest.FixtureRequest, checkpoints: Checkpoints, fresh_outputs: FreshOutputs
) -> Iterator[Engine]:
    from refit_zmq.vllm import engine_args

    with running_engine(checkpoints, engine_args(), request.param, fresh_outputs) as running:
        yield running


@pytest.fixture(scope="module")
def generation(engine: Engine) -> Any:
    from refit_zmq.vllm import VllmRelayGeneration

    return VllmRelayGeneration([engine.llm], relay_timeout_s=20.0)


@pytest.fixture(scope="module")
def proxy(generation: Any) -> Iterator[_CorruptNth]:
    proxy = _CorruptNth(generation.relay_addresses()[0])
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def policy(checkpoints: Checkpoints) -> CheckpointPolicy:
    return CheckpointPolicy(checkpoints, "A")


@pytest.fixture(scope="module")
def synchronizer(
    generation: Any, proxy: _CorruptNth, policy: CheckpointPolicy
) -> Iterator[WeightSynchronizer]:
    with sparse_synchronizer(policy, ProxiedRelays(generation, proxy), 120.0) as synchronizer:
        yield synchronizer


def _refit(
    engine: Engine, synchronizer: WeightSynchronizer, policy: CheckpointPolicy, state: str
) -> Any:
    policy.state = state
    return synchronizer.sync_weights(engine.next_version())


def test_every_worker_runs_a_relay_and_refits_equal_vllms_own_load(
    engine: Engine,
    generation: Any,
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    checkpoints: Checkpoints,
) -> None:
    llm = engine.llm
    assert len(generation.relay_addresses()) == engine.tp
    generate(llm, expect_cached=True)  # B' prefixes are cached now
    _refit(engine, synchronizer, policy, "A")  # the first refit: a dense resync
    assert generate(llm, expect_cached=False) == engine.expected["A"], "the commit reset the cache"
    _refit(engine, synchronizer, policy, "B'")
    assert generate(llm, expect_cached=False) == engine.expected["B'"]
    result = _refit(engine, synchronizer, policy, "B''")
    assert result.changed_elements is not None
    assert 0 < result.changed_elements < 0.03 * result.dense_bytes / 2
    assert result.wire_bytes < result.dense_bytes / 4, "a 1% change travels sparse"
    assert generate(llm, expect_cached=False) == engine.expected["B''"]
    assert llm.llm_engine.get_weight_version() == str(result.version)
    if engine.tp == 1:  # a worker holding whole tensors reads every one back, bit for bit
        from refit_zmq.vllm.calls import CheckpointDigests
        from refit_zmq.vllm.engines import call_workers

        (digests,) = call_workers(llm, "engine", CheckpointDigests(), 120.0)
        assert digests == state_digest(checkpoints.tensors["B''"].items())
    _refit(engine, synchronizer, policy, "B'")
    assert generate(llm) == engine.expected["B'"]


def test_refit_corrupted_mid_way_leaves_the_previous_weights(
    engine: Engine, synchronizer: WeightSynchronizer, policy: CheckpointPolicy, proxy: _CorruptNth
) -> None:
    served = engine.llm.llm_engine.get_weight_version()
    policy.state = "B''"
    proxy.corrupt_chunk(3)  # earlier payloads are staged, a later one is corrupted
    with pytest.raises(RefitError, match="checksum"):
        synchronizer.sync_weights(engine.next_version())
    assert proxy.corrupted == 1
    assert generate(engine.llm) == engine.expected["B'"], "exactly the previous weights"
    assert engine.llm.llm_engine.get_weight_version() == served
    _refit(engine, synchronizer, policy, "B''")  # the same refit again, uncorrupted
    assert generate(engine.llm, expect_cached=False) == engine.expected["B''"]
    _refit(engine, synchronizer, policy, "B'")


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_refit_whose_producer_fails_mid_stream_leaves_the_previous_weights(
    engine: Engine,
    generation: Any,
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    checkpoints: Checkpoints,
    fault: str,
) -> None:
    from refit_zmq.relay import ShardProducerRole
    from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer

    names = len(checkpoints.tensors["B'"])
    paths = [checkpoints.paths["B'"], checkpoints.paths["B''"]]
    # a dense resync to B', then the sparse refit to B'' dies half-way through its tensors
    producer = ChildParticipant("producer 0", sparse_producer, paths, fault, names + names // 2)
    child = ZmqSparseWeightSynchronizer(
        [producer],
        generation.relay_addresses,
        refit_timeout_s=DEADLINE_S,
        options=ZmqSparseOptions(bucket_size_bytes=int(SPARSE_BUCKET_GB * (1 << 30))),
        on_commit=generation.refit_committed,
    )
    try:
        producer.call(ShardProducerRole.refit_close).result(
            timeout=120
        )  # started: the deadline is the refit's
        child.sync_weights(engine.next_version())
        served = engine.llm.llm_engine.get_weight_version()
        with pytest.raises(RefitError):
            child.sync_weights(engine.next_version())
        assert generate(engine.llm) == engine.expected["B'"], "exactly the previous weights"
        assert engine.llm.llm_engine.get_weight_version() == served
    finally:
        producer.close()  # gone before the synchronizer says goodbye to it
        child.shutdown()
    synchronizer.reconcile_communicator()  # the relays' tree was the other synchronizer's
    _refit(engine, synchronizer, policy, "B''")  # the next refit, from a live trainer
    assert generate(engine.llm) == engine.expected["B''"]
    _refit(engine, synchronizer, policy, "B'")


def test_a_load_that_leaves_a_kernel_on_the_old_weights_fails_and_closes_the_engine(
    engine: Engine, synchronizer: WeightSynchronizer, policy: CheckpointPolicy
) -> None:
    with stale_kernel(engine.llm), pytest.raises(RefitError) as failed:
        _refit(engine, synchronizer, policy, "A")
    assert failed_verification(failed.value), failed.value
    closed_until_a_refit(
        engine, failed.value, lambda state, staged: _refit(engine, synchronizer, policy, state)
    )


def test_timings_name_the_whole_call_the_load_included(
    engine: Engine, synchronizer: WeightSynchronizer, policy: CheckpointPolicy
) -> None:
    for state in ("B''", "B'"):  # deltas: the engine loads the writes at ``pause``
        policy.state = state
        timings_add_up(synchronizer, engine.next_version(), ("connect", "transfer", "pause"))
    assert generate(engine.llm) == engine.expected["B'"]
