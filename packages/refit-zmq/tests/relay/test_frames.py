"""The frame codec: round trips, authentication, and a fuzz of the parser.

``REFIT_HYPOTHESIS_PROFILE=full`` runs the fuzz with 10,000 frame lists (400 by default).
"""

from __future__ import annotations

import os

import pytest
from frame_strategies import frame_lists
from hypothesis import event, given, settings

from refit_core import AuthenticationError, ProtocolError
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import Kind, Message, encode, parse

FUZZ_EXAMPLES = 10_000 if os.environ.get("REFIT_HYPOTHESIS_PROFILE") == "full" else 400
NO_KEY = Signer(None)
KEYED = Signer("k3y")

T = "v3-00000000000000ab"
EXAMPLES: dict[Kind, dict[str, object]] = {
    Kind.BEGIN: {
        "transfer_id": T,
        "producer_id": "shard-0",
        "payload_id": "0.1",
        "checksum": "0f" * 16,
        "total_bytes": 10,
        "verification_candidates": 4,
        "relay_root": "tcp://127.0.0.1:1",
        "base": None,
        "target": 3,
        "deadline_s": 9.5,
        "hops": 0,
    },
    Kind.READY: {"transfer_id": T, "producer_id": "p", "payload_id": "1", "relay": "tcp://h:1"},
    Kind.QUEUED: {"transfer_id": T, "producer_id": "p", "payload_id": "1", "relay": "tcp://h:1"},
    Kind.ACK: {
        "transfer_id": T,
        "producer_id": "p",
        "payload_id": "1",
        "relay": "tcp://h:1",
        "duplicate": False,
        "result": {"items": 3, "nested": [1, {"a": None}]},
    },
    Kind.NACK: {"code": "BUSY", "message": "full", "relay": "tcp://h:1", "retryable": True},
    Kind.FLUSH: {"request_id": "r", "transfer_id": T, "expected_payloads": 3, "wait_s": 2.5},
    Kind.COMMIT: {"request_id": "r", "transfer_id": T},
    Kind.ABORT: {"request_id": "r", "transfer_id": T},
    Kind.STATUS: {"request_id": "r", "digests": True},
    Kind.CONFIGURE: {
        "request_id": "r",
        "relays": ["tcp://a:1", "tcp://b:2"],
        "own_address": "tcp://b:2",
        "fanout": 2,
    },
    Kind.OUTCOME: {"request_id": "r", "transfer_id": T},
    Kind.DONE: {"request_id": "r", "relay": "tcp://a:1", "result": {}},
}


@pytest.mark.parametrize("kind", list(EXAMPLES))
def test_every_kind_round_trips_with_and_without_a_key(kind: Kind) -> None:
    for signer in (NO_KEY, KEYED):
        message = parse(encode(kind, EXAMPLES[kind], signer), signer)
        expected = dict(EXAMPLES[kind])
        assert (message.kind, dict(message.fields), message.body) == (kind, expected, None)


def test_data_carries_its_chunk() -> None:
    fields = {"transfer_id": T, "producer_id": "p", "payload_id": "1", "checksum": "0" * 32}
    data = encode(Kind.DATA, {**fields, "total_bytes": 9, "offset": 4}, KEYED, b"12345")
    message = parse(data, KEYED)
    assert message.body is not None and bytes(message.body) == b"12345"
    past_end = encode(Kind.DATA, {**fields, "total_bytes": 8, "offset": 4}, KEYED, b"12345")
    with pytest.raises(ProtocolError, match="past"):
        parse(past_end, KEYED)


def test_mac_is_checked_before_anything_else() -> None:
    frames = encode(Kind.STATUS, {"request_id": "r"}, Signer("other"))
    with pytest.raises(AuthenticationError, match="does not match"):
        parse(frames, KEYED)
    with pytest.raises(AuthenticationError, match="no API key"):
        parse(encode(Kind.STATUS, {"request_id": "r"}, NO_KEY), KEYED)
    with pytest.raises(AuthenticationError):
        parse([b"not json at all", b""], KEYED)
    with pytest.raises(AuthenticationError, match="has no API key"):
        parse(encode(Kind.STATUS, {"request_id": "r"}, KEYED), NO_KEY)  # a MAC, but no key
    assert "k3y" not in repr(KEYED)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"target": 4}, "transfer id names"),
        ({"target": None}, "target"),
        ({"base": 3}, "below the target"),
        ({"transfer_id": "v3-ab"}, "16 lowercase hex"),
        ({"transfer_id": "t1"}, "v<target version>"),
        ({"deadline_s": -1.0}, "deadline_s"),
    ],
)
def test_begin_names_its_target_as_its_transfer_id_does(
    change: dict[str, object], error: str
) -> None:
    with pytest.raises(ProtocolError, match=error):
        parse(encode(Kind.BEGIN, {**EXAMPLES[Kind.BEGIN], **change}, NO_KEY), NO_KEY)


@pytest.mark.parametrize("missing", ["base", "target", "deadline_s"])
def test_begin_without_versions_or_deadline_is_refused(missing: str) -> None:
    fields = {k: v for k, v in EXAMPLES[Kind.BEGIN].items() if k != missing}
    with pytest.raises(ProtocolError, match=f"lacks.*{missing}"):
        parse(encode(Kind.BEGIN, fields, NO_KEY), NO_KEY)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"request_id": "r", "digests": 1}, "true or false"),
        ({"request_id": "r", "surprise": 1}, "unknown fields"),
        ({}, "lacks"),
        ({"request_id": "bad id!"}, "request_id"),
    ],
)
def test_bad_fields_are_refused(fields: dict[str, object], error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        parse(encode(Kind.STATUS, fields, NO_KEY), NO_KEY)


@pytest.mark.parametrize(
    "header",
    [
        b'{"protocol":"refit-zmq/1","kind":"STATUS","request_id":"r","request_id":"s"}',
        b"[1]",
        b'{"protocol":"refit-zmq/1","kind":"STATUS","request_id":"r","digests":NaN}',
        b"\xff",
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_hostile_json_is_refused(header: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse([header, b""], NO_KEY)


@settings(max_examples=FUZZ_EXAMPLES)
@given(frames=frame_lists)
def test_parser_refuses_garbage_with_typed_errors_only(frames: list[bytes]) -> None:
    for signer in (NO_KEY, KEYED):
        try:
            message = parse(frames, signer)
        except (ProtocolError, AuthenticationError) as exc:
            event(f"refused: {type(exc).__name__}: {str(exc)[:24]}")
            continue
        event(f"parsed: {message.kind}")
        assert isinstance(message, Message)
        again = parse(encode(message.kind, dict(message.fields), signer, message.body), signer)
        assert again.fields == message.fields
