"""The sparse synchronizer over relays in child processes (producers in this process): a
partition held from the second DATA message, abort included; a dead relay reconciled away and
the refit retried many times without a live relay ever declared dead; structured errors."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from relay_helpers import TUNING, RelayFleet, RelaySpec, State, digests, make_state, step_state

from refit_core import ChecksumMismatchError, EngineState, Recovery, RefitError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_core.sources import StateDictSource
from refit_lab.zmq_faults import CorruptingRelayProxy, PartitioningRelayProxy
from refit_zmq.relay import RelayCoordinator, RelayStatus
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer, shard_producers

pytestmark = pytest.mark.timeout(300)

REFIT_TIMEOUT_S = 4.0
RELAY_TIMEOUT_S = 8.0
OPTIONS = ZmqSparseOptions(
    shard_count=1, bucket_size_bytes=128 * 1024, call_timeout_s=5.0, tuning=TUNING
)


class _Weights:
    """A trainer whose state moves one step at a time (a ``PolicyLike``)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._seed = 0

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)

    def step(self) -> None:
        self._seed += 1
        self.state = step_state(self.state, seed=1000 + self._seed)


def _synchronizer(weights: _Weights, relays: list[str]) -> ZmqSparseWeightSynchronizer:
    return ZmqSparseWeightSynchronizer(
        shard_producers(weights, OPTIONS.shard_count),
        lambda: list(relays),
        refit_timeout_s=REFIT_TIMEOUT_S,
        options=OPTIONS,
    )


def _held(addresses: list[str]) -> dict[str, RelayStatus | RefitError]:
    coordinator = RelayCoordinator(api_key=None, timeout_s=5.0, tuning=TUNING)
    try:
        return coordinator.status(digests=True, relays=addresses, deadline=Deadline.never())
    finally:
        coordinator.close()


def _closed_and_holding(address: str, expected: dict[str, int]) -> bool:
    (status,) = _held([address]).values()
    assert isinstance(status, RelayStatus), status
    return not status.open_transfers and status.digests == expected


@pytest.fixture
def fleet() -> Iterator[RelayFleet]:
    with RelayFleet([RelaySpec(seed=7, timeout_s=RELAY_TIMEOUT_S)] * 3) as relays:
        yield relays


def test_a_partition_from_the_second_data_message_is_closed_by_the_relay_and_the_next_refit_commits(
    fleet: RelayFleet,
) -> None:
    proxy = PartitioningRelayProxy(fleet.addresses[2])
    relays = [*fleet.addresses[:2], proxy.address]
    weights = _Weights(make_state(7))
    sync = _synchronizer(weights, relays)
    try:
        sync.sync_weights()
        old = digests(weights.state)
        weights.step()
        proxy.partition_after(1)  # held from the second DATA message on, the abort included
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError) as failed:
            sync.sync_weights()
        assert time.monotonic() - started <= REFIT_TIMEOUT_S + 1.0, "not by the deadline + 1 s"
        error = failed.value
        assert proxy.cut and proxy.held > 0
        assert error.failed_shards == (2,) and error.recovery is Recovery.RECOVER
        assert [(e.shard, e.state, e.version) for e in error.engines] == [
            (0, EngineState.OLD, 1),
            (1, EngineState.OLD, 1),
            (2, EngineState.UNKNOWN, None),
        ]
        assert len(str(error).splitlines()) == 1, "one line"

        # behind the partition, the relay ends the transfer alone: it never prepared it
        waited = _wait(lambda: _closed_and_holding(fleet.addresses[2], old), RELAY_TIMEOUT_S)
        assert waited <= RELAY_TIMEOUT_S, "not closed within the relay's timeout"
        proxy.heal()  # the held chunks, FLUSH and ABORT arrive late: refused, nothing applied
        time.sleep(0.5)
        assert _closed_and_holding(fleet.addresses[2], old)

        sync.reconcile_communicator(())
        assert sync.sync_weights().version == 3, "version 2 began and failed: never reused"
        held = _held(fleet.addresses)
        assert all(
            isinstance(s, RelayStatus) and s.digests == digests(weights.state)
            for s in held.values()
        )

        weights.step()
        with _synchronizer(weights, relays) as successor:  # a new controller, same relays
            assert successor.sync_weights().version == 4, "above what the relays hold"
    finally:
        sync.shutdown()
        proxy.close()


def _wait(check: object, within_s: float) -> float:
    started = time.monotonic()
    assert callable(check)
    while not check():
        assert time.monotonic() - started < within_s, "did not happen in time"
        time.sleep(0.1)
    return time.monotonic() - started


RETRIES = 50


def test_reconcile_and_retry_many_times_never_declares_a_live_relay_dead(
    fleet: RelayFleet,
) -> None:
    """A dead relay, left out and put back over and over: every refit without it commits,
    every refit with it fails naming it (shard 2) and only it."""
    weights = _Weights(make_state(7))
    sync = _synchronizer(weights, list(fleet.addresses))
    try:
        sync.sync_weights()
        fleet.kill(2)
        weights.step()
        with pytest.raises(RefitTimeoutError) as failed:
            sync.sync_weights()  # the status probe finds it dead
        assert failed.value.failed_shards == (2,), failed.value
        assert sync.is_stale()
        for attempt in range(RETRIES):
            if attempt % 10 == 0:
                with pytest.raises(RefitError) as refused:
                    sync.reconcile_communicator(())  # the dead relay back in the tree
                assert refused.value.failed_shards == (2,), refused.value
            sync.reconcile_communicator({2})
            weights.step()
            result = sync.sync_weights()
            assert {w.worker for w in result.workers} == set(fleet.addresses[:2])
        held = _held(fleet.addresses[:2])
        assert all(
            isinstance(s, RelayStatus) and s.digests == digests(weights.state)
            for s in held.values()
        )
    finally:
        sync.shutdown()


def test_a_corrupted_payload_names_the_relay_that_refused_it(fleet: RelayFleet) -> None:
    """One byte flipped on its way to relay 0 (the producer's root): relay 0 refuses the
    payload (CHECKSUM), the transfer aborts everywhere, every relay serves its old bits, and
    the error says which shard refused it (``failed_shards``); a retry as is succeeds."""
    proxy = CorruptingRelayProxy(fleet.addresses[0])
    relays = [proxy.address, *fleet.addresses[1:]]
    weights = _Weights(make_state(7))
    sync = _synchronizer(weights, relays)
    try:
        sync.sync_weights()
        old = digests(weights.state)
        weights.step()
        proxy.arm()
        with pytest.raises(ChecksumMismatchError) as failed:
            sync.sync_weights()
        error = failed.value
        assert proxy.corrupted == 1
        assert error.recovery is Recovery.RETRY and error.failed_shards == (0,)
        assert [(e.shard, e.state) for e in error.engines] == [
            (0, EngineState.OLD),
            (1, EngineState.OLD),
            (2, EngineState.OLD),
        ]
        assert "CHECKSUM" in (error.engines[0].reason or "")
        assert all(
            isinstance(s, RelayStatus) and s.digests == old for s in _held(fleet.addresses).values()
        )
        assert sync.sync_weights().ok, "retried as the hint says"
    finally:
        sync.shutdown()
        proxy.close()
