"""The protocol's reports as typed values: what an ACK, a DONE and a flush report carry.

Every report is a frozen dataclass with ``to_json`` (the JSON object that travels in a
header's ``result``) and ``from_json`` (which checks every field and refuses a missing, an
unknown or a mistyped one with ``ProtocolError``). PROTOCOL.md has a field table for each.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

from refit_core import ProtocolError
from refit_zmq.relay.wire.errors import NackCode

__all__ = [
    "FAILURE_CODES",
    "AbortReply",
    "ApplyResult",
    "ChildCounts",
    "CommitReply",
    "Failure",
    "FlushReport",
    "LedgerOpen",
    "OutcomeReply",
    "ReceiverOpen",
    "ReceiverStatus",
    "RelayStatus",
    "SubtreeReport",
    "TransferState",
    "TreeReply",
]

_T = TypeVar("_T")
_MAX_INT = (1 << 63) - 1

FAILURE_CODES = frozenset({*NackCode, "UNREACHABLE", "TIMEOUT", "DEADLINE", "DIGEST"})
"""Codes of a failure record: a NACK code, or UNREACHABLE (a relay stopped answering),
TIMEOUT (a flush or a partial payload ran out of time), DEADLINE (the transfer's deadline
passed before this relay was prepared) and, at the coordinator, DIGEST."""


class TransferState(enum.StrEnum):
    """Where a transfer stands on one relay.

    ``OPEN``: payloads may still come; ``PREPARED``: the relay answered a FLUSH complete and
    waits for the decision (it never aborts on its own then); ``COMMITTED`` and ``ABORTED``:
    finished; ``UNKNOWN``: the relay has no record of it.
    """

    OPEN = "open"
    PREPARED = "prepared"
    COMMITTED = "committed"
    ABORTED = "aborted"
    UNKNOWN = "unknown"


class _Reader:
    """Typed access to a JSON object's fields; every problem is a ``ProtocolError``."""

    def __init__(self, data: object, what: str) -> None:
        if not isinstance(data, dict):
            raise ProtocolError(f"{what} is not an object")
        self._data: dict[str, Any] = data
        self._what = what
        self._read: set[str] = set()

    def _get(self, name: str, optional: bool) -> Any:
        self._read.add(name)
        if name not in self._data:
            if optional:
                return None
            raise ProtocolError(f"{self._what} lacks {name!r}")
        return self._data[name]

    def _fail(self, name: str, what: str) -> ProtocolError:
        return ProtocolError(f"{self._what} field {name!r} must be {what}")

    def text(self, name: str) -> str:
        value = self._get(name, False)
        if not isinstance(value, str) or len(value) > 4096:
            raise self._fail(name, "a string of at most 4096 characters")
        return value

    def optional_text(self, name: str) -> str | None:
        return None if self._get(name, True) is None else self.text(name)

    def integer(self, name: str) -> int:
        value = self._get(name, False)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
            raise self._fail(name, "an integer in [0, 2**63)")
        return value

    def optional_integer(self, name: str) -> int | None:
        return None if self._get(name, True) is None else self.integer(name)

    def seconds(self, name: str) -> float:
        value = self._get(name, False)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(name, "a number")
        if not (math.isfinite(value) and value >= 0):
            raise self._fail(name, "a finite number >= 0")
        return float(value)

    def optional_seconds(self, name: str) -> float | None:
        return None if self._get(name, True) is None else self.seconds(name)

    def flag(self, name: str) -> bool:
        value = self._get(name, False)
        if not isinstance(value, bool):
            raise self._fail(name, "true or false")
        return value

    def state(self, name: str) -> TransferState:
        value = self._get(name, False)
        try:
            return TransferState(value)
        except ValueError:
            raise self._fail(name, f"one of {[s.value for s in TransferState]}") from None

    def mapping(self, name: str, read: Callable[[object, str], _T]) -> dict[str, _T]:
        value = self._get(name, False)
        if not isinstance(value, dict):
            raise self._fail(name, "an object")
        return {str(key): read(item, f"{self._what}.{name}[{key}]") for key, item in value.items()}

    def optional_mapping(
        self, name: str, read: Callable[[object, str], _T]
    ) -> dict[str, _T] | None:
        return None if self._get(name, True) is None else self.mapping(name, read)

    def items(self, name: str, read: Callable[[object, str], _T]) -> tuple[_T, ...]:
        value = self._get(name, False)
        if not isinstance(value, list):
            raise self._fail(name, "a list")
        return tuple(read(item, f"{self._what}.{name}[{i}]") for i, item in enumerate(value))

    def nested(self, name: str, read: Callable[[object, str], _T]) -> _T | None:
        value = self._get(name, True)
        return None if value is None else read(value, f"{self._what}.{name}")

    def done(self) -> None:
        """Refuse fields that were not read (unknown to this protocol version)."""
        unknown = sorted(self._data.keys() - self._read)
        if unknown:
            raise ProtocolError(f"{self._what} has unknown fields {unknown[:4]}")


def _digest(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ProtocolError(f"{what} must be a 64-bit unsigned digest")
    return value


def _plain(value: object) -> Any:
    """A report field as JSON: enums by value, reports by ``to_json``, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, _Report):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


Read = Callable[["_Reader", str], Any]
"""Reads one field of a report (a :class:`_Reader` method, or one built from it)."""


def _each(parse: Callable[[object, str], Any]) -> Read:
    return lambda read, name: read.items(name, parse)


def _by_name(parse: Callable[[object, str], Any]) -> Read:
    return lambda read, name: read.mapping(name, parse)


def _optional_digests(read: _Reader, name: str) -> dict[str, int] | None:
    return read.optional_mapping(name, _digest)


def _nested(parse: Callable[[object, str], Any]) -> Read:
    return lambda read, name: read.nested(name, parse)


class _Report:
    """``to_json`` and ``from_json`` of a frozen dataclass report, from its field readers.

    ``_READ`` maps every field, in order, to how it is read; ``_OMIT`` names the optional
    fields left out of the JSON when None.
    """

    _READ: ClassVar[dict[str, Read]]
    _OMIT: ClassVar[frozenset[str]] = frozenset()
    _WHAT: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        """The JSON object that travels in a header's ``result``."""
        values = {name: getattr(self, name) for name in self._READ}
        return {
            name: _plain(value)
            for name, value in values.items()
            if value is not None or name not in self._OMIT
        }

    @classmethod
    def from_json(cls, data: object, what: str | None = None) -> Self:
        """The report in ``data``.

        Raises:
            ProtocolError: a field is missing, unknown, or of the wrong type or range.
        """
        read = _Reader(data, what or cls._WHAT)
        values = {name: reader(read, name) for name, reader in cls._READ.items()}
        read.done()
        try:
            return cls(**values)
        except ValueError as exc:
            raise ProtocolError(f"{what or cls._WHAT}: {exc}") from None


@dataclass(frozen=True)
class Failure(_Report):
    """One failure recorded by a relay (or, for DIGEST, by the coordinator).

    Attributes:
        relay: the relay the failure is about (a child that stopped answering is named by
            its parent).
        code: one of :data:`FAILURE_CODES`.
        message: what happened, one line.
        producer_id: the payload's producer, when the failure is about a payload.
        payload_id: the payload, when the failure is about a payload.
    """

    _READ: ClassVar[dict[str, Read]] = {
        "relay": _Reader.text,
        "code": _Reader.text,
        "message": _Reader.text,
        "producer_id": _Reader.optional_text,
        "payload_id": _Reader.optional_text,
    }
    _OMIT: ClassVar[frozenset[str]] = frozenset({"producer_id", "payload_id"})
    _WHAT: ClassVar[str] = "failure"

    relay: str
    code: str
    message: str
    producer_id: str | None = None
    payload_id: str | None = None

    def __post_init__(self) -> None:
        if self.code not in FAILURE_CODES:
            raise ValueError(f"unknown failure code {self.code!r}")


@dataclass(frozen=True)
class ApplyResult(_Report):
    """What a receiver did with one payload (an ACK's ``result``).

    Attributes:
        items: tensor spans the payload carried.
        nbytes: the payload's size in bytes.
        verified: entries read back after the apply and found equal to the values sent.
    """

    _READ: ClassVar[dict[str, Read]] = {
        "items": _Reader.integer,
        "nbytes": _Reader.integer,
        "verified": _Reader.integer,
    }
    _WHAT: ClassVar[str] = "ACK result"

    items: int
    nbytes: int
    verified: int


@dataclass(frozen=True)
class ChildCounts(_Report):
    """What a relay forwarded to one child in one transfer, and how it ended."""

    _READ: ClassVar[dict[str, Read]] = {
        "forwarded": _Reader.integer,
        "acked": _Reader.integer,
        "failed": _Reader.integer,
    }
    _WHAT: ClassVar[str] = "child counts"

    forwarded: int = 0
    acked: int = 0
    failed: int = 0


@dataclass(frozen=True)
class FlushReport(_Report):
    """A relay's answer to FLUSH: what it did for a transfer, and whether it is prepared.

    Attributes:
        relay: the answering relay.
        transfer_id: the transfer.
        state: the transfer's state here after the flush (``prepared`` when ``complete``).
        complete: every expected payload applied here without a failure, none in flight,
            and every payload forwarded was acknowledged by its child; never true while
            ``failures`` is not empty.
        expected: the payloads the flush waited for (0: whatever began).
        applied: payloads applied here (each counted once).
        duplicates: BEGINs of payloads already applied (answered without applying again).
        bytes_received: payload bytes received here.
        bytes_forwarded: payload bytes sent to children.
        apply_s: seconds the receiver spent applying.
        elapsed_s: seconds from the transfer's first message here to its last payload
            settling here (applied or failed), or to this report when none settled.
        version: the committed version the receiver holds.
        children: child address -> what was forwarded to it.
        failures: every failure, this relay's and its children's.
        digests: with ``digests`` asked, tensor name -> ``tensor_digest`` as held when
            answering (xxh3-64 of ``"{dtype}|{shape}|"`` then the raw element bits in
            row-major order); None otherwise, or when the receiver could not give them.
    """

    _READ: ClassVar[dict[str, Read]] = {
        "relay": _Reader.text,
        "transfer_id": _Reader.text,
        "state": _Reader.state,
        "complete": _Reader.flag,
        "expected": _Reader.integer,
        "applied": _Reader.integer,
        "duplicates": _Reader.integer,
        "bytes_received": _Reader.integer,
        "bytes_forwarded": _Reader.integer,
        "apply_s": _Reader.seconds,
        "elapsed_s": _Reader.seconds,
        "version": _Reader.optional_integer,
        "children": _by_name(ChildCounts.from_json),
        "failures": _each(Failure.from_json),
        "digests": _optional_digests,
    }
    _WHAT: ClassVar[str] = "flush report"

    relay: str
    transfer_id: str
    state: TransferState
    complete: bool
    expected: int
    applied: int
    duplicates: int
    bytes_received: int
    bytes_forwarded: int
    apply_s: float
    elapsed_s: float
    version: int | None
    children: Mapping[str, ChildCounts] = field(default_factory=dict)
    failures: tuple[Failure, ...] = ()
    digests: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.complete and self.failures:
            raise ValueError("a flush report with failures is never complete")


@dataclass(frozen=True)
class SubtreeReport(_Report):
    """The answer to FLUSH with ``subtree``: relay address -> its flush report."""

    _READ: ClassVar[dict[str, Read]] = {"relays": _by_name(FlushReport.from_json)}
    _WHAT: ClassVar[str] = "subtree report"

    relays: Mapping[str, FlushReport]


@dataclass(frozen=True)
class CommitReply(_Report):
    """The answer to COMMIT.

    Attributes:
        transfer_id: the transfer.
        version: the version the receiver holds now (the transfer's target).
        committed: True when this request committed it; False when it was committed before
            (a repeated COMMIT).
    """

    _READ: ClassVar[dict[str, Read]] = {
        "transfer_id": _Reader.text,
        "version": _Reader.optional_integer,
        "committed": _Reader.flag,
    }
    _WHAT: ClassVar[str] = "COMMIT reply"

    transfer_id: str
    version: int | None
    committed: bool


@dataclass(frozen=True)
class AbortReply(_Report):
    """The answer to ABORT.

    Attributes:
        transfer_id: the transfer.
        version: the version the receiver holds now (the one before the transfer).
        aborted: True when this request ended the transfer here (it was open); False when
            it had ended before (a repeated ABORT, or the relay aborted it on its own) or
            was never seen here.
        restored: True when this request rolled back bits the transfer had applied here;
            False when nothing of it stayed applied (for example its only payload failed and
            was undone at once).
    """

    _READ: ClassVar[dict[str, Read]] = {
        "transfer_id": _Reader.text,
        "version": _Reader.optional_integer,
        "aborted": _Reader.flag,
        "restored": _Reader.flag,
    }
    _WHAT: ClassVar[str] = "ABORT reply"

    transfer_id: str
    version: int | None
    aborted: bool
    restored: bool


@dataclass(frozen=True)
class ReceiverOpen(_Report):
    """The transfer a receiver holds open: payloads applied with their undo data kept."""

    _READ: ClassVar[dict[str, Read]] = {
        "transfer_id": _Reader.text,
        "target": _Reader.integer,
        "payloads": _Reader.integer,
        "undo_bytes": _Reader.integer,
    }
    _WHAT: ClassVar[str] = "receiver open transfer"

    transfer_id: str
    target: int
    payloads: int
    undo_bytes: int


@dataclass(frozen=True)
class ReceiverStatus:
    """What a receiver holds: its committed version, its open transfer, its digests, and
    the highest version a transfer ever began on it (None: it cannot say)."""

    version: int | None
    open: ReceiverOpen | None = None
    digests: Mapping[str, int] | None = None
    began: int | None = None


@dataclass(frozen=True)
class LedgerOpen(_Report):
    """The transfer a relay's ledger holds open.

    Attributes:
        transfer_id: the transfer.
        target: the version it brings receivers to.
        state: ``open`` or ``prepared``.
        deadline_s: seconds left until the transfer's deadline here (0 once passed; None
            when the transfer carries none).
        payloads: payloads applied here so far.
        failures: failures recorded so far.
    """

    _READ: ClassVar[dict[str, Read]] = {
        "transfer_id": _Reader.text,
        "target": _Reader.optional_integer,
        "state": _Reader.state,
        "deadline_s": _Reader.optional_seconds,
        "payloads": _Reader.integer,
        "failures": _Reader.integer,
    }
    _WHAT: ClassVar[str] = "ledger open transfer"

    transfer_id: str
    target: int | None
    state: TransferState
    deadline_s: float | None
    payloads: int
    failures: int


@dataclass(frozen=True)
class RelayStatus(_Report):
    """The answer to STATUS: the receiver's state and the relay's, read together.

    Attributes:
        relay: the answering relay.
        version: the committed version its receiver holds.
        open: the receiver's open transfer (payloads applied, undo kept), or None.
        transfer: the ledger's open transfer, or None. A transfer is open on a relay when
            either is not None (a ledger opens a transfer at its first BEGIN, a receiver at
            its first payload applied).
        tree: the configured tree's id (None before CONFIGURE).
        staged_bytes: payload bytes staged now.
        peak_staged_bytes: the most payload bytes ever staged at once.
        digests: with ``digests`` asked, tensor name -> ``tensor_digest``; else None.
        began: the highest version a transfer ever began on the receiver, committed or
            not (None: the receiver cannot say; an older relay leaves it out).
    """

    _READ: ClassVar[dict[str, Read]] = {
        "relay": _Reader.text,
        "version": _Reader.optional_integer,
        "open": _nested(ReceiverOpen.from_json),
        "transfer": _nested(LedgerOpen.from_json),
        "tree": _Reader.optional_text,
        "staged_bytes": _Reader.integer,
        "peak_staged_bytes": _Reader.integer,
        "digests": _optional_digests,
        "began": _Reader.optional_integer,
    }
    _WHAT: ClassVar[str] = "STATUS result"

    relay: str
    version: int | None
    open: ReceiverOpen | None
    transfer: LedgerOpen | None
    tree: str | None
    staged_bytes: int
    peak_staged_bytes: int
    digests: Mapping[str, int] | None = None
    began: int | None = None

    @property
    def open_transfers(self) -> frozenset[str]:
        """Every transfer id the ledger or the receiver holds open."""
        ids = {opened.transfer_id for opened in (self.open, self.transfer) if opened}
        return frozenset(ids)


@dataclass(frozen=True)
class OutcomeReply(_Report):
    """The answer to OUTCOME: what became of a transfer on the answering relay."""

    _READ: ClassVar[dict[str, Read]] = {"transfer_id": _Reader.text, "state": _Reader.state}
    _WHAT: ClassVar[str] = "OUTCOME result"

    transfer_id: str
    state: TransferState


@dataclass(frozen=True)
class TreeReply(_Report):
    """The answer to CONFIGURE: the id of the tree the relay adopted."""

    _READ: ClassVar[dict[str, Read]] = {"tree": _Reader.text}
    _WHAT: ClassVar[str] = "CONFIGURE result"

    tree: str
