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
from typing import Any, TypeVar

from refit_core.errors import ProtocolError
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


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in data.items() if value is not None}


@dataclass(frozen=True)
class Failure:
    """One failure recorded by a relay (or, for DIGEST, by the coordinator).

    Attributes:
        relay: the relay the failure is about (a child that stopped answering is named by
            its parent).
        code: one of :data:`FAILURE_CODES`.
        message: what happened, one line.
        producer_id: the payload's producer, when the failure is about a payload.
        payload_id: the payload, when the failure is about a payload.
    """

    relay: str
    code: str
    message: str
    producer_id: str | None = None
    payload_id: str | None = None

    def __post_init__(self) -> None:
        if self.code not in FAILURE_CODES:
            raise ProtocolError(f"unknown failure code {self.code!r}")

    def to_json(self) -> dict[str, Any]:
        return _drop_none(
            {
                "relay": self.relay,
                "code": self.code,
                "message": self.message,
                "producer_id": self.producer_id,
                "payload_id": self.payload_id,
            }
        )

    @classmethod
    def from_json(cls, data: object, what: str = "failure") -> Failure:
        read = _Reader(data, what)
        failure = cls(
            read.text("relay"),
            read.text("code"),
            read.text("message"),
            read.optional_text("producer_id"),
            read.optional_text("payload_id"),
        )
        read.done()
        return failure

    def line(self) -> str:
        """``relay [payload p]: CODE: message``."""
        payload = f" payload {self.payload_id}" if self.payload_id is not None else ""
        return f"{self.relay}{payload}: {self.code}: {self.message}"


@dataclass(frozen=True)
class ApplyResult:
    """What a receiver did with one payload (an ACK's ``result``).

    Attributes:
        items: tensor spans the payload carried.
        nbytes: the payload's size in bytes.
        verified: entries read back after the apply and found equal to the values sent.
    """

    items: int
    nbytes: int
    verified: int

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "nbytes": self.nbytes, "verified": self.verified}

    @classmethod
    def from_json(cls, data: object, what: str = "ACK result") -> ApplyResult:
        read = _Reader(data, what)
        result = cls(read.integer("items"), read.integer("nbytes"), read.integer("verified"))
        read.done()
        return result


@dataclass(frozen=True)
class ChildCounts:
    """What a relay forwarded to one child in one transfer, and how it ended."""

    forwarded: int = 0
    acked: int = 0
    failed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"forwarded": self.forwarded, "acked": self.acked, "failed": self.failed}

    @classmethod
    def from_json(cls, data: object, what: str = "child counts") -> ChildCounts:
        read = _Reader(data, what)
        counts = cls(read.integer("forwarded"), read.integer("acked"), read.integer("failed"))
        read.done()
        return counts


@dataclass(frozen=True)
class FlushReport:
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

    def to_json(self) -> dict[str, Any]:
        return {
            "relay": self.relay,
            "transfer_id": self.transfer_id,
            "state": self.state.value,
            "complete": self.complete,
            "expected": self.expected,
            "applied": self.applied,
            "duplicates": self.duplicates,
            "bytes_received": self.bytes_received,
            "bytes_forwarded": self.bytes_forwarded,
            "apply_s": self.apply_s,
            "elapsed_s": self.elapsed_s,
            "version": self.version,
            "children": {a: c.to_json() for a, c in self.children.items()},
            "failures": [f.to_json() for f in self.failures],
            "digests": None if self.digests is None else dict(self.digests),
        }

    @classmethod
    def from_json(cls, data: object, what: str = "flush report") -> FlushReport:
        read = _Reader(data, what)
        complete = read.flag("complete")
        failures = read.items("failures", Failure.from_json)
        if complete and failures:
            raise ProtocolError(f"{what} says complete with {len(failures)} failures")
        report = cls(
            relay=read.text("relay"),
            transfer_id=read.text("transfer_id"),
            state=read.state("state"),
            complete=complete,
            expected=read.integer("expected"),
            applied=read.integer("applied"),
            duplicates=read.integer("duplicates"),
            bytes_received=read.integer("bytes_received"),
            bytes_forwarded=read.integer("bytes_forwarded"),
            apply_s=read.seconds("apply_s"),
            elapsed_s=read.seconds("elapsed_s"),
            version=read.optional_integer("version"),
            children=read.mapping("children", ChildCounts.from_json),
            failures=failures,
            digests=read.optional_mapping("digests", _digest),
        )
        read.done()
        return report


@dataclass(frozen=True)
class SubtreeReport:
    """The answer to FLUSH with ``subtree``: relay address -> its flush report."""

    relays: Mapping[str, FlushReport]

    def to_json(self) -> dict[str, Any]:
        return {"relays": {a: r.to_json() for a, r in self.relays.items()}}

    @classmethod
    def from_json(cls, data: object, what: str = "subtree report") -> SubtreeReport:
        read = _Reader(data, what)
        report = cls(read.mapping("relays", FlushReport.from_json))
        read.done()
        return report


@dataclass(frozen=True)
class CommitReply:
    """The answer to COMMIT.

    Attributes:
        transfer_id: the transfer.
        version: the version the receiver holds now (the transfer's target).
        committed: True when this request committed it; False when it was committed before
            (a repeated COMMIT).
    """

    transfer_id: str
    version: int | None
    committed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "version": self.version,
            "committed": self.committed,
        }

    @classmethod
    def from_json(cls, data: object, what: str = "COMMIT reply") -> CommitReply:
        read = _Reader(data, what)
        reply = cls(
            read.text("transfer_id"), read.optional_integer("version"), read.flag("committed")
        )
        read.done()
        return reply


@dataclass(frozen=True)
class AbortReply:
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

    transfer_id: str
    version: int | None
    aborted: bool
    restored: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "version": self.version,
            "aborted": self.aborted,
            "restored": self.restored,
        }

    @classmethod
    def from_json(cls, data: object, what: str = "ABORT reply") -> AbortReply:
        read = _Reader(data, what)
        reply = cls(
            read.text("transfer_id"),
            read.optional_integer("version"),
            read.flag("aborted"),
            read.flag("restored"),
        )
        read.done()
        return reply


@dataclass(frozen=True)
class ReceiverOpen:
    """The transfer a receiver holds open: payloads applied with their undo data kept."""

    transfer_id: str
    target: int
    payloads: int
    undo_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "target": self.target,
            "payloads": self.payloads,
            "undo_bytes": self.undo_bytes,
        }

    @classmethod
    def from_json(cls, data: object, what: str = "receiver open transfer") -> ReceiverOpen:
        read = _Reader(data, what)
        opened = cls(
            read.text("transfer_id"),
            read.integer("target"),
            read.integer("payloads"),
            read.integer("undo_bytes"),
        )
        read.done()
        return opened


@dataclass(frozen=True)
class ReceiverStatus:
    """What a receiver holds: its committed version, its open transfer, its digests."""

    version: int | None
    open: ReceiverOpen | None = None
    digests: Mapping[str, int] | None = None


@dataclass(frozen=True)
class LedgerOpen:
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

    transfer_id: str
    target: int | None
    state: TransferState
    deadline_s: float | None
    payloads: int
    failures: int

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "target": self.target,
            "state": self.state.value,
            "deadline_s": self.deadline_s,
            "payloads": self.payloads,
            "failures": self.failures,
        }

    @classmethod
    def from_json(cls, data: object, what: str = "ledger open transfer") -> LedgerOpen:
        read = _Reader(data, what)
        opened = cls(
            read.text("transfer_id"),
            read.optional_integer("target"),
            read.state("state"),
            read.optional_seconds("deadline_s"),
            read.integer("payloads"),
            read.integer("failures"),
        )
        read.done()
        return opened


@dataclass(frozen=True)
class RelayStatus:
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
    """

    relay: str
    version: int | None
    open: ReceiverOpen | None
    transfer: LedgerOpen | None
    tree: str | None
    staged_bytes: int
    peak_staged_bytes: int
    digests: Mapping[str, int] | None = None

    @property
    def open_transfers(self) -> frozenset[str]:
        """Every transfer id the ledger or the receiver holds open."""
        ids = {opened.transfer_id for opened in (self.open, self.transfer) if opened}
        return frozenset(ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "relay": self.relay,
            "version": self.version,
            "open": None if self.open is None else self.open.to_json(),
            "transfer": None if self.transfer is None else self.transfer.to_json(),
            "tree": self.tree,
            "staged_bytes": self.staged_bytes,
            "peak_staged_bytes": self.peak_staged_bytes,
            "digests": None if self.digests is None else dict(self.digests),
        }

    @classmethod
    def from_json(cls, data: object, what: str = "STATUS result") -> RelayStatus:
        read = _Reader(data, what)
        status = cls(
            relay=read.text("relay"),
            version=read.optional_integer("version"),
            open=read.nested("open", ReceiverOpen.from_json),
            transfer=read.nested("transfer", LedgerOpen.from_json),
            tree=read.optional_text("tree"),
            staged_bytes=read.integer("staged_bytes"),
            peak_staged_bytes=read.integer("peak_staged_bytes"),
            digests=read.optional_mapping("digests", _digest),
        )
        read.done()
        return status


@dataclass(frozen=True)
class OutcomeReply:
    """The answer to OUTCOME: what became of a transfer on the answering relay."""

    transfer_id: str
    state: TransferState

    def to_json(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "state": self.state.value}

    @classmethod
    def from_json(cls, data: object, what: str = "OUTCOME result") -> OutcomeReply:
        read = _Reader(data, what)
        reply = cls(read.text("transfer_id"), read.state("state"))
        read.done()
        return reply


@dataclass(frozen=True)
class TreeReply:
    """The answer to CONFIGURE: the id of the tree the relay adopted."""

    tree: str

    def to_json(self) -> dict[str, Any]:
        return {"tree": self.tree}

    @classmethod
    def from_json(cls, data: object, what: str = "CONFIGURE result") -> TreeReply:
        read = _Reader(data, what)
        reply = cls(read.text("tree"))
        read.done()
        return reply
