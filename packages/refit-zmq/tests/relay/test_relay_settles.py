"""A relay decides alone when nobody decides for it, and the coordinator can settle at once.

Transfers left open by any fault (a BEGIN and nothing more, a sender gone half-way, a
deadline passed, a coordinator that never decided, a relay frozen with payloads in its socket
buffer) end on their own: unprepared ones are rolled back at their deadline or after the
relay's timeout; prepared ones ask the other relays what became of them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from relay_helpers import TUNING, RelayFleet, RelaySpec, Trainer, digests, make_state
from wire_helpers import Wire, begin_fields, frame_chunks, payload_ids, stream

from refit_core import WeightVersion
from refit_core.backend import Deadline
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import (
    RelayCoordinator,
    RelayStatus,
    TensorReceiver,
    TransferState,
    ZmqSparseRefitServer,
    new_transfer_id,
)

pytestmark = pytest.mark.timeout(120)


def _relays(count: int, timeout_s: float) -> list[ZmqSparseRefitServer]:
    relays = [
        ZmqSparseRefitServer(
            TensorReceiver(make_state(91), version=0),
            api_key_env_var=None,
            timeout_s=timeout_s,
            tuning=TUNING,
        )
        for _ in range(count)
    ]
    addresses = [relay.start() for relay in relays]
    for relay, address in zip(relays, addresses, strict=True):
        relay.configure_tree(addresses, own_address=address)
    return relays


@pytest.fixture
def delta() -> Iterator[tuple[DeltaPayload, dict[str, int]]]:
    """One payload of a 1% delta from version 0 to 1, and the digests it brings."""
    trainer = Trainer(make_state(91), version=0, bucket_bytes=4 << 20)
    try:
        trainer.step(seed=92)
        (payload,) = trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1))
        yield payload, digests(trainer.state)
    finally:
        trainer.close()


def _until(check: Callable[[], bool], within_s: float) -> float:
    """Seconds until ``check()`` held (polled); fails after ``within_s``."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, "did not happen in time"
        time.sleep(0.05)
    return time.monotonic() - started


def _closed(relay: ZmqSparseRefitServer) -> bool:
    status = relay.status()
    return status.open is None and status.transfer is None


def test_a_transfer_left_open_after_its_begin_closes_within_the_relays_timeout(
    delta: tuple[DeltaPayload, dict[str, int]],
) -> None:
    (relay,) = _relays(1, timeout_s=1.0)
    wire = Wire(relay.status().relay)
    payload, _ = delta
    try:
        wire.send("BEGIN", **begin_fields(payload, new_transfer_id(1), deadline_s=None))
        assert wire.reply()["kind"] == "READY"
        transfer = relay.status().transfer
        assert transfer is not None and transfer.state is TransferState.OPEN
        waited = _until(lambda: _closed(relay), within_s=1.0 + 2.0)
        assert waited <= 1.0 + 1.0, f"closed after {waited:.1f} s"
        next_one = stream(
            wire, payload, begin_fields(payload, new_transfer_id(1)), frame_chunks(payload)
        )
        assert next_one["kind"] == "ACK", "the relay takes the next transfer"
    finally:
        wire.close()
        relay.close()


def test_at_its_deadline_an_unprepared_transfer_is_rolled_back_and_late_chunks_refused(
    delta: tuple[DeltaPayload, dict[str, int]],
) -> None:
    (relay,) = _relays(1, timeout_s=30.0)
    wire = Wire(relay.status().relay)
    payload, _ = delta
    before = digests(make_state(91))
    transfer_id = new_transfer_id(1)
    try:
        wire.send("BEGIN", **begin_fields(payload, transfer_id, deadline_s=1.0))
        assert wire.reply()["kind"] == "READY"
        chunks = frame_chunks(payload)
        ids = payload_ids(transfer_id, payload)
        for offset, chunk in chunks[:-1]:  # all but the last frame: written, not finished
            wire.send("DATA", chunk=chunk, offset=offset, **ids)
        _until(lambda: relay.status(digests=True).digests != before, within_s=5.0)
        _until(lambda: _closed(relay), within_s=1.0 + 2.0)
        assert relay.status(digests=True).digests == before, "rolled back at the deadline"
        offset, chunk = chunks[-1]
        wire.send("DATA", chunk=chunk, offset=offset, **ids)
        late = wire.reply()
        assert (late["kind"], late["code"]) == ("NACK", "STALE_TRANSFER"), late
        wire.send("BEGIN", **begin_fields(payload, transfer_id))
        assert wire.reply()["code"] == "STALE_TRANSFER"
        assert relay.status(digests=True).digests == before, "nothing applied after it"
    finally:
        wire.close()
        relay.close()


def _prepared_pair(relays: list[ZmqSparseRefitServer], payload: DeltaPayload, wire: Wire) -> str:
    """Stream ``payload`` through the first relay (it forwards to the second) and flush
    both: the transfer is prepared on each; its id."""
    transfer_id = new_transfer_id(1)
    ack = stream(wire, payload, begin_fields(payload, transfer_id), frame_chunks(payload))
    assert ack["kind"] == "ACK", ack
    for relay in relays:
        report = relay.flush(transfer_id, 1, timeout_s=10.0)
        assert report.complete and report.state is TransferState.PREPARED, report
    return transfer_id


@pytest.mark.parametrize("decision", ["COMMIT", "ABORT"])
def test_a_prepared_relay_that_missed_the_decision_asks_its_peers(
    delta: tuple[DeltaPayload, dict[str, int]], decision: str
) -> None:
    relays = _relays(2, timeout_s=1.0)
    decided, waiting = relays
    wire = Wire(decided.status().relay)
    payload, after = delta
    try:
        transfer_id = _prepared_pair(relays, payload, wire)
        reply = wire.request(decision, transfer_id=transfer_id)  # the second relay misses it
        assert reply["kind"] == "DONE", reply
        _until(lambda: _closed(waiting), within_s=1.0 + 5.0)
        status = waiting.status(digests=True)
        expected = (1, after) if decision == "COMMIT" else (0, digests(make_state(91)))
        assert (status.version, status.digests) == expected
    finally:
        wire.close()
        for relay in relays:
            relay.close()


def test_close_open_transfers_finishes_what_only_a_ledger_holds_at_once(
    delta: tuple[DeltaPayload, dict[str, int]],
) -> None:
    (relay,) = _relays(1, timeout_s=60.0)
    address = relay.status().relay
    wire = Wire(address)
    coordinator = RelayCoordinator(api_key=None, timeout_s=5.0, tuning=TUNING)
    payload, _ = delta
    try:
        coordinator.configure_tree([address], deadline=Deadline.never())
        wire.send("BEGIN", **begin_fields(payload, new_transfer_id(1), deadline_s=None))
        assert wire.reply()["kind"] == "READY"
        held = relay.status()
        assert held.open is None and held.transfer is not None, "open in the ledger only"
        started = time.monotonic()
        (status,) = coordinator.close_open_transfers(deadline=Deadline.never()).values()
        assert isinstance(status, RelayStatus) and status.open_transfers == frozenset()
        assert time.monotonic() - started < 5.0
    finally:
        coordinator.close()
        wire.close()
        relay.close()


@pytest.mark.parametrize("committed_somewhere", [False, True])
def test_a_new_coordinator_settles_what_a_dead_one_left(
    delta: tuple[DeltaPayload, dict[str, int]], committed_somewhere: bool
) -> None:
    relays = _relays(2, timeout_s=60.0)
    addresses = [relay.status().relay for relay in relays]
    wire = Wire(addresses[0])
    payload, after = delta
    successor = RelayCoordinator(api_key=None, timeout_s=5.0, tuning=TUNING)
    try:
        transfer_id = _prepared_pair(relays, payload, wire)  # its coordinator died here
        if committed_somewhere:  # ... or after delivering its COMMIT to one relay
            assert wire.request("COMMIT", transfer_id=transfer_id)["kind"] == "DONE"
        successor.configure_tree(addresses, deadline=Deadline.never())
        statuses = successor.close_open_transfers(deadline=Deadline.never())
        version = 1 if committed_somewhere else 0
        expected = after if committed_somewhere else digests(make_state(91))
        for status in statuses.values():
            assert isinstance(status, RelayStatus) and not status.open_transfers
            assert status.version == version
        assert all(r.status(digests=True).digests == expected for r in relays)
    finally:
        successor.close()
        wire.close()
        for relay in relays:
            relay.close()


def test_a_relay_frozen_with_payloads_in_its_socket_never_applies_them_after_the_deadline(
    delta: tuple[DeltaPayload, dict[str, int]],
) -> None:
    """The chaos run's mixed case: SIGSTOP after READY, every chunk queued in the frozen
    relay's socket, SIGCONT after the deadline: nothing of it is applied."""
    payload, _ = delta
    with RelayFleet([RelaySpec(seed=91, timeout_s=30.0)]) as fleet:
        wire = Wire(fleet.addresses[0])
        transfer_id = new_transfer_id(1)
        try:
            wire.send("BEGIN", **begin_fields(payload, transfer_id, deadline_s=1.5))
            assert wire.reply()["kind"] == "READY"
            os.kill(fleet.pids[0], signal.SIGSTOP)
            try:
                ids = payload_ids(transfer_id, payload)
                for offset, chunk in frame_chunks(payload):
                    wire.send("DATA", chunk=chunk, offset=offset, **ids)
                time.sleep(1.5 + 0.5)  # past the deadline, the chunks wait in the socket
            finally:
                os.kill(fleet.pids[0], signal.SIGCONT)
            reply = wire.reply()
            assert (reply["kind"], reply["code"]) == ("NACK", "STALE_TRANSFER"), reply
            status = wire.request("STATUS", digests=True)["result"]
            assert (status["open"], status["transfer"]) == (None, None)
            assert status["digests"] == digests(make_state(91)), "applied after its deadline"
        finally:
            wire.close()
