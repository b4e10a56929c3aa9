"""Every rule PROTOCOL.md states, sent broken on the wire in plain pyzmq: the relay answers
with the documented NACK and applies nothing.

Messages are built by hand (:mod:`wire_helpers`: JSON header, MAC frame, chunk), as a client
written from the specification alone would; only the payload bytes come from refit's codec.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from relay_helpers import TUNING, Trainer, digests, make_state
from wire_helpers import Wire, begin_fields, frame_chunks, stream

from refit_core import WeightVersion
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import TensorReceiver, ZmqSparseRefitServer, new_transfer_id

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def relay() -> Iterator[tuple[ZmqSparseRefitServer, str]]:
    server = ZmqSparseRefitServer(
        TensorReceiver(make_state(91), version=0),
        api_key_env_var=None,
        timeout_s=30.0,
        tuning=TUNING,
    )
    address = server.start()
    server.configure_tree([address], own_address=address)
    try:
        yield server, address
    finally:
        server.close()


@pytest.fixture
def wire(relay: tuple[ZmqSparseRefitServer, str]) -> Iterator[Wire]:
    created = Wire(relay[1])
    try:
        yield created
    finally:
        created.close()


@pytest.fixture
def delta() -> Iterator[DeltaPayload]:
    """One payload of a 1% delta from version 0 to 1 against ``make_state(91)``."""
    trainer = Trainer(make_state(91), version=0)
    try:
        trainer.step(seed=92)
        yield next(iter(trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1))))
    finally:
        trainer.close()


def _untouched(server: ZmqSparseRefitServer) -> bool:
    """Nothing applied: the receiver holds ``make_state(91)`` at version 0, nothing open."""
    status = server.status(digests=True)
    return (status.version, status.open, status.digests) == (0, None, digests(make_state(91)))


def _nack(reply: dict[str, Any], code: str, text: str) -> None:
    assert (reply["kind"], reply["code"]) == ("NACK", code), reply
    assert text in reply["message"], reply["message"]


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
    _nack(stream(wire, delta, begin, frame_chunks(delta)), "MALFORMED", text)
    assert _untouched(relay[0])


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
    _nack(wire.reply(), "MALFORMED", text)
    assert _untouched(relay[0])


def test_commit_needs_a_prepared_flush(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload
) -> None:
    server, _ = relay
    transfer_id = new_transfer_id(1)
    ack = stream(wire, delta, begin_fields(delta, transfer_id), frame_chunks(delta))
    assert ack["kind"] == "ACK" and ack["result"]["items"] >= 1, ack
    _nack(wire.request("COMMIT", transfer_id=transfer_id), "CONFLICT", "not prepared")
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
    _nack(reply, "MALFORMED", "two frames")
    assert _untouched(relay[0])


def test_a_mac_sent_to_a_relay_without_a_key_is_refused(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload
) -> None:
    wire.send("STATUS", mac=b"\x01" * 32, request_id="r1")
    _nack(wire.reply(), "AUTH", "has no API key")
    wire.send("BEGIN", mac=b"\x01" * 32, **begin_fields(delta, new_transfer_id(1)))
    _nack(wire.reply(), "AUTH", "has no API key")
    assert _untouched(relay[0])
