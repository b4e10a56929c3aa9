"""A relay's record of transfers: which is open, which are finished, what each one did.

The ledger enforces the transport's half of the transaction rules: one open transfer at a
time, finished transfer ids refused, a payload id admitted once per transfer (the same id
with another checksum refused), versions that only move forward, and each transfer's
deadline (kept on this relay's monotonic clock, from the seconds left that its BEGIN
carried). A transfer is open until it is committed or aborted; once this relay answered a
FLUSH complete it is *prepared*, and from then on only a decision ends it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from refit_core.backend import Deadline
from refit_zmq.relay.wire.errors import StaleTransferError, TransferConflictError
from refit_zmq.relay.wire.reports import (
    ApplyResult,
    ChildCounts,
    Failure,
    FlushReport,
    LedgerOpen,
    TransferState,
)

__all__ = ["Ledger", "TransferRecord"]

_FINISHED_KEPT = 1024

PayloadRef = tuple[str, str]
"""``(producer_id, payload_id)`` within a transfer."""


@dataclass
class _Counts:
    forwarded: int = 0
    acked: int = 0
    failed: int = 0


@dataclass
class TransferRecord:
    """What one relay did for one transfer.

    Attributes:
        deadline: the ``time.monotonic()`` instant of the transfer's deadline here (None:
            it carries none).
        active_at: when a message about the transfer last arrived or one of its payloads
            last settled (an open transfer idle for the relay's timeout is aborted).
    """

    transfer_id: str
    target: int | None
    state: TransferState = TransferState.OPEN
    deadline: float | None = None
    started_at: float = field(default_factory=time.monotonic)
    active_at: float = field(default_factory=time.monotonic)
    settled_at: float | None = None
    checksums: dict[PayloadRef, str] = field(default_factory=dict)
    results: dict[PayloadRef, ApplyResult] = field(default_factory=dict)
    failed: set[PayloadRef] = field(default_factory=set)
    failures: list[Failure] = field(default_factory=list)
    duplicates: int = 0
    bytes_received: int = 0
    bytes_forwarded: int = 0
    apply_s: float = 0.0
    children: dict[str, _Counts] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        """Open or prepared: not finished."""
        return self.state in (TransferState.OPEN, TransferState.PREPARED)

    def overdue(self, now: float) -> bool:
        """Whether the transfer's deadline has passed."""
        return self.deadline is not None and now >= self.deadline

    def deadline_left(self, now: float) -> float | None:
        """Seconds left until the deadline (0 once passed; None without one)."""
        return None if self.deadline is None else max(0.0, self.deadline - now)

    def touch(self, now: float) -> None:
        """A message about the transfer arrived."""
        self.active_at = now

    def child(self, address: str) -> _Counts:
        """Counters of one child."""
        return self.children.setdefault(address, _Counts())

    def settle(self, now: float, *, active: bool = True) -> None:
        """A payload settled here: applied or refused (``active``), or dropped because its
        sender went quiet (which is no sign of life)."""
        self.settled_at = now
        if active:
            self.active_at = now

    def fail(self, failure: Failure, *, local: bool) -> None:
        """Record a failure of this relay (``local``) or of one of its children."""
        if local and failure.producer_id is not None and failure.payload_id is not None:
            self.failed.add((failure.producer_id, failure.payload_id))
        self.failures.append(failure)

    def report(
        self, relay: str, *, complete: bool, expected: int, version: int | None, now: float
    ) -> FlushReport:
        """The flush report (without digests)."""
        end = self.settled_at if self.settled_at is not None else now
        return FlushReport(
            relay=relay,
            transfer_id=self.transfer_id,
            state=self.state,
            complete=complete,
            expected=expected,
            applied=len(self.results),
            duplicates=self.duplicates,
            bytes_received=self.bytes_received,
            bytes_forwarded=self.bytes_forwarded,
            apply_s=self.apply_s,
            elapsed_s=max(0.0, end - self.started_at),
            version=version,
            children={
                a: ChildCounts(c.forwarded, c.acked, c.failed) for a, c in self.children.items()
            },
            failures=tuple(self.failures),
        )

    def summary(self, now: float) -> LedgerOpen:
        """The open transfer as STATUS reports it."""
        return LedgerOpen(
            self.transfer_id,
            self.target,
            self.state,
            self.deadline_left(now),
            len(self.results),
            len(self.failures),
        )


class Ledger:
    """Transfers seen by one relay, with the receiver's committed version mirrored."""

    def __init__(self, version: int | None) -> None:
        self.version = version
        self.current: TransferRecord | None = None
        self._finished: OrderedDict[str, TransferRecord] = OrderedDict()

    def record(self, transfer_id: str) -> TransferRecord | None:
        """The open or a recently finished transfer of that id."""
        if self.current is not None and self.current.transfer_id == transfer_id:
            return self.current
        return self._finished.get(transfer_id)

    def state(self, transfer_id: str) -> TransferState:
        """What became of ``transfer_id`` here (``unknown`` when never seen, or forgotten)."""
        record = self.record(transfer_id)
        return TransferState.UNKNOWN if record is None else record.state

    def open(self, transfer_id: str, target: int, deadline: Deadline, now: float) -> TransferRecord:
        """The open record of ``transfer_id``, opening it if no other transfer is open.

        Args:
            transfer_id: the transfer a BEGIN names.
            target: the version it brings receivers to.
            deadline: its deadline as the BEGIN carried it (``Deadline.from_wire``); the
                record keeps the earliest deadline it was given.
            now: ``time.monotonic()``.

        A payload against another base is not refused here: the relay still forwards it to
        its subtree, and the receiver refuses to apply it (STALE_BASE).

        Raises:
            StaleTransferError: the transfer is finished or past its deadline, or ``target``
                does not advance.
            TransferConflictError: another transfer is open, or another target.
        """
        finished = self._finished.get(transfer_id)
        if finished is not None:
            raise StaleTransferError(f"transfer {transfer_id} is already {finished.state}")
        if self.version is not None and target <= self.version:
            raise StaleTransferError(
                f"transfer {transfer_id} targets version {target}, relay holds {self.version}"
            )
        at = deadline.at
        if at is not None and now >= at:
            raise StaleTransferError(f"transfer {transfer_id} is past its deadline")
        current = self.current
        if current is None:
            self.current = TransferRecord(transfer_id, target, deadline=at)
            return self.current
        if current.transfer_id != transfer_id:
            raise TransferConflictError(
                f"transfer {current.transfer_id} is still open; {transfer_id} must wait"
            )
        if current.overdue(now):
            raise StaleTransferError(f"transfer {transfer_id} is past its deadline")
        if current.target != target:
            raise TransferConflictError(
                f"transfer {transfer_id} targets {target} and {current.target}"
            )
        if at is not None and (current.deadline is None or at < current.deadline):
            current.deadline = at
        current.touch(now)
        return current

    def finish(self, transfer_id: str, state: TransferState, version: int | None) -> bool:
        """Close ``transfer_id`` as ``state`` (committed or aborted); whether it was live."""
        record = self.record(transfer_id) or TransferRecord(transfer_id, None)
        was_live = record.live and self.current is record
        record.state = state
        if self.current is record:
            self.current = None
        self._finished[transfer_id] = record
        self._finished.move_to_end(transfer_id)
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)
        self.version = version
        return was_live
