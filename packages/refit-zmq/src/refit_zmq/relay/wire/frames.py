"""Frames of relay protocol 2: message kinds, header fields, encoding and the validating parser.

A message is ``[header, mac]`` or, for DATA, ``[header, mac, chunk]``: the header is one
UTF-8 JSON object, the MAC is HMAC-SHA256 of the header bytes under the API key (empty
without a key), the chunk is raw payload bytes. :func:`parse` checks the MAC, then every
field of the header against the table below, and raises ``ProtocolError`` (or
``AuthenticationError``) for anything else; nothing is ever unpickled or evaluated.
PROTOCOL.md is the specification.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from refit_core import ProtocolError
from refit_zmq.codec.format import BytesLike
from refit_zmq.relay.wire.errors import NackCode

if TYPE_CHECKING:
    from refit_zmq.relay.wire.auth import Signer

__all__ = [
    "MAX_HEADER_BYTES",
    "PROTOCOL",
    "QUEUE_TIMEOUTS",
    "BytesLike",
    "Kind",
    "Message",
    "encode",
    "parse",
    "reply_ids",
    "transfer_target",
]

PROTOCOL = "refit-zmq/2"
MAX_HEADER_BYTES = 256 * 1024
MAX_RELAYS = 4096
QUEUE_TIMEOUTS = 2.0
"""A relay keeps a BEGIN waiting for room (answering QUEUED) at most this many of its
``timeout_s``; room held for a silent child is freed within one."""
_MAX_INT = (1 << 63) - 1
_MAX_WAIT_S = 24 * 3600.0
_IDENT = re.compile(r"[A-Za-z0-9_.:@/+-]{1,128}")
_ADDRESS = re.compile(r"(tcp|ipc|inproc)://[^\s]{1,500}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_TRANSFER_ID = re.compile(r"v(0|[1-9][0-9]{0,18})-[0-9a-f]{16}")


class Kind(enum.StrEnum):
    """Message kinds; requests go to a relay's ROUTER, replies come back on the same link."""

    BEGIN = "BEGIN"
    DATA = "DATA"
    READY = "READY"
    QUEUED = "QUEUED"
    ACK = "ACK"
    NACK = "NACK"
    FLUSH = "FLUSH"
    COMMIT = "COMMIT"
    ABORT = "ABORT"
    STATUS = "STATUS"
    CONFIGURE = "CONFIGURE"
    OUTCOME = "OUTCOME"
    DONE = "DONE"


def _fail(name: str, what: str) -> ProtocolError:
    return ProtocolError(f"header field {name!r}: {what}")


def _ident(name: str, value: object) -> None:
    if not isinstance(value, str) or not _IDENT.fullmatch(value):
        raise _fail(name, "must be 1-128 characters of [A-Za-z0-9_.:@/+-]")


def _transfer_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not _TRANSFER_ID.fullmatch(value):
        raise _fail(name, "must be v<target version>-<16 lowercase hex digits>")
    if int(value[1 : value.index("-")]) > _MAX_INT:
        raise _fail(name, "names a target version beyond 2**63")


def transfer_target(transfer_id: str) -> int:
    """The target version a (well-formed) transfer id names."""
    return int(transfer_id[1 : transfer_id.index("-")])


def _address(name: str, value: object) -> None:
    if not isinstance(value, str) or not _ADDRESS.fullmatch(value):
        raise _fail(name, "must be a tcp://, ipc:// or inproc:// address")


def _uint(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise _fail(name, "must be an integer in [0, 2**63)")


def _optional(check: Callable[[str, object], None]) -> Callable[[str, object], None]:
    def optional(name: str, value: object) -> None:
        if value is not None:
            check(name, value)

    return optional


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(name, "must be true or false")


def _seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(name, "must be a number")
    if not (math.isfinite(value) and 0 <= value <= _MAX_WAIT_S):
        raise _fail(name, f"must be within [0, {_MAX_WAIT_S:.0f}] seconds")


def _pattern(regex: re.Pattern[str], what: str) -> Callable[[str, object], None]:
    def check(name: str, value: object) -> None:
        if not isinstance(value, str) or not regex.fullmatch(value):
            raise _fail(name, what)

    return check


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > 4096:
        raise _fail(name, "must be a string of at most 4096 characters")


def _code(name: str, value: object) -> None:
    if not isinstance(value, str) or value not in NackCode.__members__:
        raise _fail(name, "must be a known NACK code")


def _mapping(name: str, value: object) -> None:
    if not isinstance(value, dict):
        raise _fail(name, "must be an object")


def _addresses(name: str, value: object) -> None:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_RELAYS:
        raise _fail(name, f"must be a list of 1-{MAX_RELAYS} addresses")
    for item in value:
        _address(name, item)
    if len(set(value)) != len(value):
        raise _fail(name, "lists an address twice")


def _fanout(name: str, value: object) -> None:
    _uint(name, value)
    if not 1 <= cast(int, value) <= 64:
        raise _fail(name, "must be within [1, 64]")


FIELDS: dict[str, Callable[[str, object], None]] = {
    "transfer_id": _transfer_id,
    "producer_id": _ident,
    "payload_id": _ident,
    "request_id": _ident,
    "checksum": _pattern(_HEX32, "must be 32 lowercase hex digits (xxh3-128)"),
    "total_bytes": _uint,
    "offset": _uint,
    "verification_candidates": _uint,
    "expected_payloads": _uint,
    "hops": _uint,
    "chunk_bytes": _uint,
    "base": _optional(_uint),
    "target": _optional(_uint),
    "relay_root": _optional(_address),
    "tree": _optional(_pattern(_HEX16, "must be 16 lowercase hex digits")),
    "relay": _address,
    "own_address": _address,
    "relays": _addresses,
    "fanout": _fanout,
    "wait_s": _seconds,
    "deadline_s": _optional(_seconds),
    "digests": _flag,
    "subtree": _flag,
    "duplicate": _flag,
    "retryable": _flag,
    "code": _code,
    "message": _text,
    "result": _mapping,
}
"""Every header field and its check (besides ``protocol`` and ``kind``)."""

_PAYLOAD = frozenset({"transfer_id", "producer_id", "payload_id"})
_ROUTING = frozenset({"relay_root", "tree", "hops"})

REQUIRED: dict[Kind, frozenset[str]] = {
    Kind.BEGIN: _PAYLOAD
    | {"checksum", "total_bytes", "verification_candidates", "base", "target", "deadline_s"},
    Kind.DATA: _PAYLOAD | {"checksum", "total_bytes", "offset"},
    Kind.READY: _PAYLOAD | {"relay"},
    Kind.QUEUED: _PAYLOAD | {"relay"},
    Kind.ACK: _PAYLOAD | {"relay", "duplicate", "result"},
    Kind.NACK: frozenset({"code", "message", "relay", "retryable"}),
    Kind.FLUSH: frozenset({"request_id", "transfer_id", "expected_payloads", "wait_s"}),
    Kind.COMMIT: frozenset({"request_id", "transfer_id"}),
    Kind.ABORT: frozenset({"request_id", "transfer_id"}),
    Kind.STATUS: frozenset({"request_id"}),
    Kind.CONFIGURE: frozenset({"request_id", "relays", "own_address", "fanout"}),
    Kind.OUTCOME: frozenset({"request_id", "transfer_id"}),
    Kind.DONE: frozenset({"request_id", "relay", "result"}),
}
"""Fields each kind must carry."""

OPTIONAL: dict[Kind, frozenset[str]] = {
    Kind.BEGIN: _ROUTING,
    Kind.READY: frozenset({"chunk_bytes"}),
    Kind.DATA: _ROUTING,
    Kind.NACK: _PAYLOAD | {"request_id"},
    Kind.FLUSH: frozenset({"digests", "subtree"}),
    Kind.STATUS: frozenset({"digests"}),
}
"""Fields each kind may carry; any other field is refused."""


@dataclass(frozen=True)
class Message:
    """A validated message: its kind, header fields and (DATA only) its chunk."""

    kind: Kind
    fields: Mapping[str, Any]
    body: memoryview | None = None

    def text(self, name: str) -> str:
        """A string field the kind requires."""
        value = self.fields[name]
        assert isinstance(value, str)
        return value

    def optional_text(self, name: str) -> str | None:
        """A string field that may be absent or null."""
        value = self.fields.get(name)
        assert value is None or isinstance(value, str)
        return value

    def number(self, name: str, default: int | None = None) -> int:
        """An integer field (``default`` when absent)."""
        value = self.fields.get(name, default)
        assert isinstance(value, int)
        return value

    def optional_number(self, name: str) -> int | None:
        """An integer field that may be absent or null."""
        value = self.fields.get(name)
        assert value is None or isinstance(value, int)
        return value

    def seconds(self, name: str) -> float:
        """A duration field."""
        return float(self.fields[name])

    def flag(self, name: str) -> bool:
        """A boolean field (False when absent)."""
        return bool(self.fields.get(name, False))

    def mapping(self, name: str) -> dict[str, Any]:
        """An object field."""
        value = self.fields[name]
        assert isinstance(value, dict)
        return value

    def strings(self, name: str) -> list[str]:
        """A list-of-strings field."""
        value = self.fields[name]
        assert isinstance(value, list)
        return [str(item) for item in value]

    @property
    def payload_key(self) -> tuple[str, str, str]:
        """``(transfer_id, producer_id, payload_id)`` of a payload message."""
        return self.text("transfer_id"), self.text("producer_id"), self.text("payload_id")


def encode(
    kind: Kind, fields: Mapping[str, Any], signer: Signer, body: BytesLike | None = None
) -> list[BytesLike]:
    """The frames of a message; None-valued optional fields are left out (a required one is
    sent as null)."""
    header = {"protocol": PROTOCOL, "kind": kind.value}
    required = REQUIRED[kind]
    header.update(
        {name: value for name, value in fields.items() if value is not None or name in required}
    )
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    frames: list[BytesLike] = [raw, signer.sign(raw)]
    if body is not None:
        frames.append(body)
    return frames


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"header holds the non-JSON constant {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ProtocolError("header repeats a field")
    return result


def _load(raw: BytesLike) -> dict[str, Any]:
    if memoryview(raw).nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header larger than {MAX_HEADER_BYTES} bytes")
    try:
        loaded = json.loads(
            bytes(raw).decode("utf-8"),
            parse_constant=_reject_constant,
            object_pairs_hook=_unique_keys,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"header is not a JSON object: {type(exc).__name__}") from None
    if not isinstance(loaded, dict):
        raise ProtocolError("header is not a JSON object")
    return loaded


def parse(frames: Sequence[BytesLike], signer: Signer) -> Message:
    """Authenticate and validate one message's frames.

    Raises:
        AuthenticationError: the MAC is missing or wrong (checked before the header is read).
        ProtocolError: anything malformed: frame count, JSON, protocol, kind, a field, a chunk.
    """
    if not _framed(frames):
        raise ProtocolError(f"message of {len(frames)} frames (2 or 3 expected)")
    signer.verify(frames[0], frames[1])
    header = _load(frames[0])
    if header.pop("protocol", None) != PROTOCOL:
        raise ProtocolError(f"not a {PROTOCOL} message")
    try:
        kind = Kind(header.pop("kind", None))
    except ValueError:
        raise ProtocolError("unknown message kind") from None
    required = REQUIRED[kind]
    missing = required - header.keys()
    if missing:
        raise ProtocolError(f"{kind} lacks {sorted(missing)}")
    unknown = header.keys() - required - OPTIONAL.get(kind, frozenset())
    if unknown:
        raise ProtocolError(f"{kind} has unknown fields {sorted(unknown)[:4]}")
    for name, value in header.items():
        FIELDS[name](name, value)
    if kind is Kind.BEGIN:
        _check_begin(header)
    body = memoryview(frames[2]).cast("B") if len(frames) == 3 else None
    if (body is not None) != (kind is Kind.DATA):
        raise ProtocolError(f"{kind} {'needs' if kind is Kind.DATA else 'takes no'} chunk frame")
    if body is not None and not 0 < len(body) <= header["total_bytes"] - header["offset"]:
        raise ProtocolError("chunk is empty or runs past the payload's end")
    return Message(kind, header, body)


def _check_begin(header: Mapping[str, Any]) -> None:
    """A BEGIN names a target, the one its transfer id names, above any base."""
    target, base = header["target"], header["base"]
    if target is None:
        raise _fail("target", "must be the version the transfer brings receivers to")
    if target != transfer_target(header["transfer_id"]):
        raise _fail("target", f"is {target}, the transfer id names {header['transfer_id']}")
    if base is not None and base >= target:
        raise _fail("base", f"must be below the target {target}")


def _framed(frames: Sequence[BytesLike]) -> bool:
    """Whether a message has the frames of one: a header, a MAC, at most a chunk."""
    return 2 <= len(frames) <= 3


def reply_ids(frames: Sequence[BytesLike]) -> dict[str, str]:
    """The well-formed id fields of a (possibly malformed) message's header, to address its
    NACK; none unless it has a MAC frame (which :func:`parse` checks before anything else of
    the header), so a refusal never echoes ids a peer without the key chose."""
    if not _framed(frames):
        return {}
    try:
        header = _load(frames[0])
    except ProtocolError:
        return {}
    ids: dict[str, str] = {}
    for name in (*sorted(_PAYLOAD), "request_id"):
        value = header.get(name)
        try:
            FIELDS[name](name, value)
        except ProtocolError:
            continue
        ids[name] = str(value)
    return ids
