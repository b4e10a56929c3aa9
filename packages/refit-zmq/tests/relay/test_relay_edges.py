"""The replies PROTOCOL.md gives at the edges of a transfer's life, asked in plain pyzmq: which
refusal wins, what a prepared transfer takes past its deadline, requests about transfers a
relay never saw or aborted, BEGINs left waiting when their transfer is aborted, CONFIGURE
naming an address outside its list, and a relay used without CONFIGURE at all."""

from __future__ import annotations

import time
from typing import Any

import pytest
from relay_helpers import digests, make_state
from wire_helpers import (
    Wire,
    begin_fields,
    frame_chunks,
    nack,
    payload_ids,
    serving_relay,
    stream,
    untouched,
)

from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import RelayTuning, ZmqSparseRefitServer, new_transfer_id

pytestmark = pytest.mark.timeout(60)


def _prepared(wire: Wire, delta: DeltaPayload, **begin: Any) -> str:
    """A transfer of ``delta`` streamed and flushed complete (prepared); its id."""
    transfer_id = new_transfer_id(1)
    ack = stream(wire, delta, begin_fields(delta, transfer_id, **begin), frame_chunks(delta))
    assert ack["kind"] == "ACK", ack
    flushed = wire.request("FLUSH", transfer_id=transfer_id, expected_payloads=1, wait_s=5.0)
    assert flushed["result"]["state"] == "prepared", flushed
    return transfer_id


def test_a_malformed_begin_is_refused_as_malformed_before_any_state_is_read(
    wire: Wire, delta: DeltaPayload
) -> None:
    transfer_id = _prepared(wire, delta)
    assert wire.request("COMMIT", transfer_id=transfer_id)["result"]["committed"] is True
    wire.send("BEGIN", **begin_fields(delta, transfer_id))  # finished: stale
    nack(wire.reply(), "STALE_TRANSFER", "")
    wire.send("BEGIN", **begin_fields(delta, transfer_id, base=5))  # finished and malformed
    nack(wire.reply(), "MALFORMED", "'base'")
    fresh = new_transfer_id(1)  # target 1, not above the version held, no time left, malformed
    wire.send("BEGIN", **begin_fields(delta, fresh, base=5, deadline_s=0))
    nack(wire.reply(), "MALFORMED", "'base'")


@pytest.mark.parametrize("decision", ["COMMIT", "ABORT"])
def test_a_prepared_transfer_past_its_deadline_takes_its_decision_and_no_payload(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire, delta: DeltaPayload, decision: str
) -> None:
    transfer_id = _prepared(wire, delta, deadline_s=1.0)
    time.sleep(1.5)
    wire.send("BEGIN", **begin_fields(delta, transfer_id))  # the applied payload, retried
    nack(wire.reply(), "STALE_TRANSFER", "deadline")
    flushed = wire.request("FLUSH", transfer_id=transfer_id, expected_payloads=1, wait_s=1.0)
    assert (flushed["result"]["state"], flushed["result"]["complete"]) == ("prepared", True)
    outcome = wire.request("OUTCOME", transfer_id=transfer_id)
    assert outcome["result"] == {"transfer_id": transfer_id, "state": "prepared"}
    done = wire.request(decision, transfer_id=transfer_id)
    if decision == "COMMIT":
        assert done["result"] == {"transfer_id": transfer_id, "version": 1, "committed": True}
    else:
        assert done["result"]["aborted"] is True and done["result"]["restored"] is True
        assert untouched(relay[0])


def test_requests_about_a_transfer_never_seen_here(wire: Wire) -> None:
    never = new_transfer_id(1)
    nack(wire.request("COMMIT", transfer_id=never), "STALE_TRANSFER", "not open here")
    flushed = wire.request("FLUSH", transfer_id=new_transfer_id(1), expected_payloads=1, wait_s=0.5)
    report = flushed["result"]
    assert (report["state"], report["complete"]) == ("unknown", False)
    assert [f["code"] for f in report["failures"]] == ["TIMEOUT"]
    outcome = wire.request("OUTCOME", transfer_id=never)
    assert outcome["result"]["state"] == "unknown"
    aborted = wire.request("ABORT", transfer_id=never)
    assert aborted["result"] == {
        "transfer_id": never,
        "version": 0,
        "aborted": False,
        "restored": False,
    }
    wire.send("BEGIN", **_begin_of(never))
    nack(wire.reply(), "STALE_TRANSFER", "")  # an ABORT marks even an unseen transfer


def _begin_of(transfer_id: str) -> dict[str, Any]:
    """A well-formed BEGIN of a 64-byte payload from version 0 to 1."""
    return {
        "producer_id": "p",
        "payload_id": "0",
        "checksum": "0" * 32,
        "total_bytes": 64,
        "verification_candidates": 0,
        "base": 0,
        "target": 1,
        "deadline_s": 10.0,
        "transfer_id": transfer_id,
    }


def test_flush_of_an_aborted_transfer_reports_it_aborted_at_once(
    wire: Wire, delta: DeltaPayload
) -> None:
    transfer_id = new_transfer_id(1)
    stream(wire, delta, begin_fields(delta, transfer_id), frame_chunks(delta))
    assert wire.request("ABORT", transfer_id=transfer_id)["result"]["restored"] is True
    started = time.monotonic()
    flushed = wire.request("FLUSH", transfer_id=transfer_id, expected_payloads=1, wait_s=10.0)
    assert time.monotonic() - started < 5.0, "a FLUSH of an aborted transfer does not wait"
    report = flushed["result"]
    assert (report["state"], report["complete"]) == ("aborted", False)
    assert [f["code"] for f in report["failures"]] == ["STALE_TRANSFER"]


def test_begins_waiting_for_room_are_refused_when_their_transfer_is_aborted(
    delta: DeltaPayload,
) -> None:
    with serving_relay(RelayTuning(window_payloads=1, chunk_bytes=64 << 10)) as (server, address):
        wire = Wire(address)
        try:
            transfer_id = new_transfer_id(1)
            wire.send("BEGIN", **begin_fields(delta, transfer_id))
            assert wire.reply()["kind"] == "READY"
            waiting = {**begin_fields(delta, transfer_id), "payload_id": "1"}
            wire.send("BEGIN", **waiting)
            assert wire.reply()["kind"] == "QUEUED"
            wire.send("ABORT", request_id="abort", transfer_id=transfer_id)
            replies = [wire.reply(), wire.reply()]
            queued = next(r for r in replies if r.get("payload_id") == "1")
            nack(queued, "STALE_TRANSFER", "was aborted")
            assert next(r for r in replies if r.get("request_id") == "abort")["kind"] == "DONE"
            first = frame_chunks(delta)[0][1]
            wire.send("DATA", chunk=first, offset=0, **payload_ids(transfer_id, delta))
            nack(wire.reply(), "STALE_TRANSFER", "aborted")  # the admitted one, at its next chunk
            assert untouched(server)
        finally:
            wire.close()


def test_configure_naming_an_address_outside_its_list_is_refused(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire
) -> None:
    server, address = relay
    tree = server.status().tree
    other = "tcp://127.0.0.1:9"
    refused = wire.request("CONFIGURE", relays=[other], own_address=address, fanout=1)
    nack(refused, "TREE", "is not among the relays")
    refused = wire.request("CONFIGURE", relays=[address], own_address=other, fanout=1)
    nack(refused, "TREE", "is not among the relays")
    assert server.status().tree == tree


def test_a_single_relay_needs_no_configure(delta: DeltaPayload) -> None:
    """Payloads without a tree or a root are this relay's own: applied, forwarded nowhere."""
    with serving_relay(configure=False) as (server, address):
        wire = Wire(address)
        try:
            assert server.status().tree is None
            wire.send("BEGIN", **begin_fields(delta, new_transfer_id(1), tree="0" * 16))
            nack(wire.reply(), "TREE", "no tree configured")
            transfer_id = _prepared(wire, delta)
            done = wire.request("COMMIT", transfer_id=transfer_id)
            assert done["result"]["version"] == 1
            assert server.status(digests=True).digests != digests(make_state(91))
        finally:
            wire.close()
