"""The relay's in-process API: start, configure_tree, flush and close, with real sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import zmq
from relay_helpers import TUNING, MiB, Trainer, digests, make_state

from refit_core import WeightVersion
from refit_core.backend import Deadline
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import (
    AbortReply,
    ApplyResult,
    CommitReply,
    ReceiverStatus,
    StreamingReceiver,
    TensorReceiver,
    TransferState,
    ZmqSparseRefitClient,
    ZmqSparseRefitServer,
    deliver_payloads,
    new_transfer_id,
)
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import Kind, encode
from refit_zmq.relay.wire.link import LinkSettings

pytestmark = pytest.mark.timeout(60)


def _deliver(
    address: str, payloads: list[DeltaPayload], transfer_id: str, *, verification_candidates: int
) -> None:
    """Send a version-0 -> 1 refit's payloads to the relay at ``address``, one at a time."""
    with ZmqSparseRefitClient(address, timeout_s=3.0, producer_id="p", retries=0) as client:
        deliver_payloads(
            payloads,
            client,
            transfer_id=transfer_id,
            payload_prefix="0",
            relay_root=address,
            base_version=0,
            target_version=1,
            verification_candidates=verification_candidates,
            senders=1,
            deadline=Deadline.never(),
        )


@pytest.fixture
def relay() -> Iterator[tuple[ZmqSparseRefitServer, TensorReceiver, str]]:
    receiver = TensorReceiver(make_state(71), version=0)
    server = ZmqSparseRefitServer(receiver, api_key_env_var=None, timeout_s=3.0, tuning=TUNING)
    address = server.start()
    try:
        yield server, receiver, address
    finally:
        server.close()


def test_flush_reports_what_was_applied_and_what_is_missing(
    relay: tuple[ZmqSparseRefitServer, TensorReceiver, str],
) -> None:
    server, receiver, address = relay
    assert address.startswith("tcp://127.0.0.1:")
    assert len(server.configure_tree([address], own_address=address)) == 16
    trainer = Trainer(make_state(71), version=0)
    try:
        trainer.step(seed=72)
        payloads = list(trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1)))
        transfer_id = new_transfer_id(1)
        assert server.flush(transfer_id).complete is True, "nothing begun, nothing to wait for"
        _deliver(address, payloads, transfer_id, verification_candidates=8)
        report = server.flush(transfer_id, len(payloads))
        assert (report.complete, report.applied, report.failures) == (True, len(payloads), ())
        assert report.state is TransferState.PREPARED, "a complete flush prepares the transfer"
        assert report.bytes_received == sum(p.nbytes for p in payloads)
        assert server.flush_subtree(transfer_id, len(payloads)) == {address: report}, (
            "a relay without children is its own subtree"
        )
        late = server.flush(transfer_id, len(payloads) + 1, timeout_s=0.3)
        assert late.complete is False and late.failures[-1].code == "TIMEOUT"
        receiver.commit(transfer_id)
        assert receiver.status(digests=True).digests == digests(trainer.state)
        trainer.shards[0].tracker.commit()
    finally:
        trainer.close()


def test_subtree_flush_names_a_silent_child_within_the_wait() -> None:
    relays = [
        ZmqSparseRefitServer(
            TensorReceiver(make_state(81), version=0),
            api_key_env_var=None,
            timeout_s=3.0,
            tuning=TUNING,
        )
        for _ in range(2)
    ]
    parent, child = (relay.start() for relay in relays)
    trainer = Trainer(make_state(81), version=0)
    try:
        for relay, own in zip(relays, (parent, child), strict=True):
            relay.configure_tree([parent, child], own_address=own)
        trainer.step(seed=82)
        payloads = list(trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1)))
        transfer_id = new_transfer_id(1)
        _deliver(parent, payloads, transfer_id, verification_candidates=0)
        healthy = relays[0].flush_subtree(transfer_id, len(payloads))
        assert set(healthy) == {parent, child}
        assert all(r.complete and r.applied == len(payloads) for r in healthy.values())

        relays[1].close()  # the child goes silent; the parent's report must name it in time
        started = time.monotonic()
        reports = relays[0].flush_subtree(transfer_id, len(payloads), timeout_s=1.0)
        assert time.monotonic() - started < 1.0 + 1.0, "not answered within the wait"
        assert reports[parent] == healthy[parent], "the parent's own report is unchanged"
        assert reports[child].complete is False
        assert [f.code for f in reports[child].failures] == ["UNREACHABLE"]
        trainer.shards[0].tracker.abort()
    finally:
        trainer.close()
        for relay in relays:
            relay.close()


def test_a_payload_whose_sender_goes_quiet_half_way_is_undone(
    relay: tuple[ZmqSparseRefitServer, TensorReceiver, str],
) -> None:
    """The receiver writes a dense payload's chunks as they arrive; when its sender stops
    half-way, the relay drops it after ``timeout_s`` and the writes are rolled back."""
    server, receiver, address = relay
    server.configure_tree([address], own_address=address)
    before = digests(make_state(71))
    trainer = Trainer(make_state(72), version=0, bucket_bytes=4 * MiB)
    try:
        (payload,) = trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1), resync=True)
    finally:
        trainer.close()
    transfer_id = new_transfer_id(1)
    ids = {"transfer_id": transfer_id, "producer_id": "p", "payload_id": "0"}
    common = {**ids, "checksum": payload.checksum, "total_bytes": payload.nbytes, "hops": 0}
    unsigned = Signer(None)
    link = LinkSettings(unsigned, None, TUNING).open(zmq.Context.instance(), address)
    try:
        versions = {"base": None, "target": 1, "deadline_s": None}
        begin = encode(Kind.BEGIN, {**common, "verification_candidates": 0, **versions}, unsigned)
        link.send(begin, until=time.monotonic() + 3)
        assert link.receive(lambda m: m.kind is Kind.READY, until=time.monotonic() + 3) is not None
        offset = 0
        for frame in payload.frames:  # chunks never hold bytes of two frames
            view = memoryview(frame).cast("B")
            for start in range(0, len(view), TUNING.chunk_bytes):
                if offset >= payload.nbytes // 2:
                    break
                chunk = view[start : start + TUNING.chunk_bytes]
                message = encode(Kind.DATA, {**common, "offset": offset}, unsigned, chunk)
                link.send(message, until=time.monotonic() + 3)
                offset += len(chunk)
        deadline = time.monotonic() + 3
        while receiver.status(digests=True).digests == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.status(digests=True).digests != before, (
            "chunks were not applied as they came"
        )
        report = server.flush(transfer_id, 1, timeout_s=6.0)
        assert report.failures and report.failures[0].code == "TIMEOUT"
        deadline = time.monotonic() + 2  # the undo runs on the receiver thread, after the report
        while receiver.status(digests=True).digests != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.status(digests=True).digests == before, "half a payload stayed applied"
    finally:
        link.close()


class _WholePayloads:
    """A receiver without ``open_payload``: the relay must hand it each payload whole."""

    def __init__(self, inner: TensorReceiver) -> None:
        self.inner = inner
        self.bodies: list[int] = []

    def apply(self, body: memoryview, metadata: Mapping[str, Any]) -> ApplyResult:
        self.bodies.append(len(body))
        return self.inner.apply(body, metadata)

    def commit(self, transfer_id: str) -> CommitReply:
        return self.inner.commit(transfer_id)

    def rollback(self, transfer_id: str) -> AbortReply:
        return self.inner.rollback(transfer_id)

    def status(self, *, digests: bool = False) -> ReceiverStatus:
        return self.inner.status(digests=digests)


def test_a_receiver_that_does_not_stream_gets_each_payload_whole() -> None:
    receiver = _WholePayloads(TensorReceiver(make_state(71), version=0))
    assert not isinstance(receiver, StreamingReceiver)
    server = ZmqSparseRefitServer(receiver, api_key_env_var=None, timeout_s=3.0, tuning=TUNING)
    address = server.start()
    trainer = Trainer(make_state(71), version=0)
    try:
        server.configure_tree([address], own_address=address)
        trainer.step(seed=73)
        payloads = list(trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1)))
        transfer_id = new_transfer_id(1)
        _deliver(address, payloads, transfer_id, verification_candidates=8)
        assert server.flush(transfer_id, len(payloads)).complete is True
        assert receiver.bodies == [p.nbytes for p in payloads]
        receiver.commit(transfer_id)
        assert receiver.status(digests=True).digests == digests(trainer.state)
    finally:
        trainer.close()
        server.close()
