"""Every rule PROTOCOL.md states, sent broken on the wire in plain pyzmq: the relay answers
with the documented NACK and applies nothing.

Messages are built by hand (:mod:`wire_helpers`: JSON header, MAC frame, chunk), as a client
written from the specification alone would; only the payload bytes come from refit's codec.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest
import zmq
from relay_helpers import KEY, TUNING, RelayFleet, Trainer, make_state
from wire_helpers import (
    PROTOCOL,
    Wire,
    begin_fields,
    frame_chunks,
    nack,
    payload_ids,
    serving_relay,
    stream,
    untouched,
)

from refit_core import WeightVersion
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import RelayTuning, ZmqSparseRefitServer, new_transfer_id

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"target": 2, "transfer_id": "v2-00000000000000c2"}, "its BEGIN from 0 to 2"),
        ({"base": None}, "its BEGIN from None to 1"),
    ],
)
def test_a_begin_whose_versions_differ_from_the_payload_items_is_refused(
    relay: tuple[ZmqSparseRefitServer, str],
    wire: Wire,
    delta: DeltaPayload,
    change: dict[str, Any],
    text: str,
) -> None:
    transfer_id = str(change.get("transfer_id", "v1-00000000000000c1"))
    begin = begin_fields(delta, transfer_id, **change)
    nack(stream(wire, delta, begin, frame_chunks(delta)), "MALFORMED", text)
    assert untouched(relay[0])


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"base": ...}, "lacks ['base']"),
        ({"target": ...}, "lacks ['target']"),
        ({"deadline_s": ...}, "lacks ['deadline_s']"),
        ({"target": None}, "'target'"),
        ({"transfer_id": "v1-xyz"}, "16 lowercase hex"),
        ({"transfer_id": "transfer-1"}, "v<target version>"),
        ({"target": 3}, "the transfer id names"),
    ],
)
def test_a_begin_without_versions_or_with_a_foreign_transfer_id_is_refused(
    relay: tuple[ZmqSparseRefitServer, str],
    wire: Wire,
    delta: DeltaPayload,
    change: dict[str, Any],
    text: str,
) -> None:
    wire.send("BEGIN", **begin_fields(delta, "v1-00000000000000c3", **change))
    nack(wire.reply(), "MALFORMED", text)
    assert untouched(relay[0])


def test_commit_needs_a_prepared_flush(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload
) -> None:
    server, _ = relay
    transfer_id = new_transfer_id(1)
    ack = stream(wire, delta, begin_fields(delta, transfer_id), frame_chunks(delta))
    assert ack["kind"] == "ACK" and ack["result"]["items"] >= 1, ack
    nack(wire.request("COMMIT", transfer_id=transfer_id), "CONFLICT", "not prepared")
    held = server.status()
    assert held.version == 0 and held.open is not None, "the payload stays open, uncommitted"
    report = wire.request("FLUSH", transfer_id=transfer_id, expected_payloads=1, wait_s=5.0)
    assert report["result"]["complete"] is True and report["result"]["state"] == "prepared"
    done = wire.request("COMMIT", transfer_id=transfer_id)
    assert done["result"] == {"transfer_id": transfer_id, "version": 1, "committed": True}


def test_a_chunk_holding_bytes_of_two_frames_is_refused(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload
) -> None:
    data = b"".join(chunk for _, chunk in frame_chunks(delta))
    head = len(bytes(memoryview(delta.frames[0]).cast("B")))
    crossing = [(0, data[: head + 1]), (head + 1, data[head + 1 :])]  # frame 0 + 1 byte
    reply = stream(wire, delta, begin_fields(delta, new_transfer_id(1)), crossing)
    nack(reply, "MALFORMED", "two frames")
    assert untouched(relay[0])


def test_a_mac_sent_to_a_relay_without_a_key_is_refused(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload
) -> None:
    wire.send("STATUS", mac=b"\x01" * 32, request_id="r1")
    nack(wire.reply(), "AUTH", "has no API key")
    wire.send("BEGIN", mac=b"\x01" * 32, **begin_fields(delta, new_transfer_id(1)))
    nack(wire.reply(), "AUTH", "has no API key")
    assert untouched(relay[0])


@pytest.mark.parametrize("frame", [0, 1])
def test_a_chunk_across_two_frames_is_refused_when_it_arrives(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload, frame: int
) -> None:
    """Frame 0 whole (or the crossing chunk itself) tells the relay where every frame ends:
    the chunk that crosses one is refused at once, not after the sender's timeout."""
    chunks = frame_chunks(delta)
    end = chunks[frame][0] + len(chunks[frame][1])
    data = b"".join(chunk for _, chunk in chunks)
    transfer_id = new_transfer_id(1)
    wire.send("BEGIN", **begin_fields(delta, transfer_id))
    assert wire.reply()["kind"] == "READY"
    ids = payload_ids(transfer_id, delta)
    start = chunks[frame][0]
    if frame:
        wire.send("DATA", chunk=chunks[0][1], offset=0, **ids)
    wire.send("DATA", chunk=data[start : end + 1], offset=start, **ids)  # one byte too many
    reply = wire.reply(timeout_s=5.0)  # the relay's own timeout is 30 s
    nack(reply, "MALFORMED", "crosses the end of a frame")
    assert reply["payload_id"] == "0"
    assert untouched(relay[0])


@pytest.fixture
def resync() -> DeltaPayload:
    """A dense resync payload of ``make_state(91)``'s first bucket (frames of 64 KiB)."""
    trainer = Trainer(make_state(91), version=0)
    try:
        payloads = trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1), resync=True)
        return next(iter(payloads))
    finally:
        trainer.close()


SMALL_CHUNKS = RelayTuning(chunk_bytes=4096, max_inflight_bytes=16 << 20)


def test_a_chunk_larger_than_ready_announced_is_refused(resync: DeltaPayload) -> None:
    chunks = frame_chunks(resync)
    assert len(chunks[1][1]) > 2 * SMALL_CHUNKS.chunk_bytes
    with serving_relay(SMALL_CHUNKS) as (server, address):
        wire = Wire(address)
        try:
            transfer_id = new_transfer_id(1)
            wire.send("BEGIN", **begin_fields(resync, transfer_id, base=None))
            ready = wire.reply()
            assert (ready["kind"], ready["chunk_bytes"]) == ("READY", 4096)
            ids = payload_ids(transfer_id, resync)
            wire.send("DATA", chunk=chunks[0][1], offset=0, **ids)
            inside = chunks[1][1][: 2 * SMALL_CHUNKS.chunk_bytes]  # within frame 1
            wire.send("DATA", chunk=inside, offset=chunks[1][0], **ids)
            nack(wire.reply(timeout_s=5.0), "MALFORMED", "exceeds the chunk_bytes 4096")
            assert untouched(server)
        finally:
            wire.close()


def test_a_frame_past_the_message_limit_closes_only_its_connection(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire
) -> None:
    """libzmq drops a frame larger than max(chunk_bytes, 256 KiB) + 64 bytes and the connection
    it came on before the relay sees it: no reply; the relay serves on."""
    disconnected = wire.watch(zmq.EVENT_DISCONNECTED)
    limit = max(TUNING.chunk_bytes, 256 << 10) + 64
    ids = {"transfer_id": new_transfer_id(1), "producer_id": "p", "payload_id": "0"}
    fields = {**ids, "checksum": "0" * 32, "total_bytes": 2 * limit, "offset": 0}
    wire.send("DATA", chunk=bytes(limit + 1), **fields)
    assert disconnected(5.0), "the relay kept the connection"
    with pytest.raises(AssertionError, match="did not answer"):
        wire.reply(timeout_s=0.5)
    with Wire(relay[1]) as other:
        assert other.request("STATUS")["kind"] == "DONE"
    assert untouched(relay[0])


def test_a_refusal_echoes_ids_only_of_a_message_whose_mac_was_checked(
    keyed_relay: RelayFleet,
) -> None:
    """A one-frame message never reaches the MAC check: its NACK names no request of anyone's
    (a forged one could otherwise answer another client's request)."""

    def mac(header: bytes) -> bytes:
        return hmac.new(KEY.encode(), header, hashlib.sha256).digest()

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(keyed_relay.addresses[0])
    try:
        header = json.dumps({"protocol": PROTOCOL, "kind": "STATUS", "request_id": "r1"}).encode()
        socket.send_multipart([header])
        assert socket.poll(10_000)
        reply, signature = socket.recv_multipart()
        assert hmac.compare_digest(signature, mac(reply))  # signed: it names nothing unchecked
        refusal = json.loads(reply)
        assert (refusal["kind"], refusal["code"]) == ("NACK", "MALFORMED")
        assert "request_id" not in refusal, refusal
        socket.send_multipart([header, mac(header)])  # signed: answered with its id
        assert socket.poll(10_000)
        reply, _ = socket.recv_multipart()
        assert json.loads(reply)["request_id"] == "r1"
    finally:
        socket.close()
