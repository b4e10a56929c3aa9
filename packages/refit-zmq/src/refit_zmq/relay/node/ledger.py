"""A relay's record of transfers: which is open, which are finished, what each one did.

The ledger enforces the transport's half of the transaction rules: one open transfer at a
time, finished transfer ids refused, a payload id admitted once per transfer (the same id
with another checksum refused), and versions that only move forward.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from refit_zmq.relay.wire.errors import StaleTransferError, TransferConflictError

__all__ = ["Ledger", "TransferRecord"]

_FINISHED_KEPT = 1024

Failure = dict[str, Any]


@dataclass
class _ChildCounts:
    forwarded: int = 0
    acked: int = 0
    failed: int = 0


@dataclass
class TransferRecord:
    """What one relay did for one transfer."""

    transfer_id: str
    target: int | None
    state: str = "open"
    started_at: float = field(default_factory=time.monotonic)
    checksums: dict[tuple[str, str], str] = field(default_factory=dict)
    results: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    failed: set[tuple[str, str]] = field(default_factory=set)
    failures: list[Failure] = field(default_factory=list)
    duplicates: int = 0
    bytes_received: int = 0
    bytes_forwarded: int = 0
    apply_s: float = 0.0
    last_applied_at: float | None = None
    children: dict[str, _ChildCounts] = field(default_factory=dict)

    def child(self, address: str) -> _ChildCounts:
        """Counters of one child."""
        return self.children.setdefault(address, _ChildCounts())

    def fail(
        self,
        relay: str,
        code: str,
        message: str,
        key: tuple[str, str] | None = None,
        *,
        local: bool,
    ) -> None:
        """Record a failure of this relay (``local``) or of one of its children."""
        failure: Failure = {"relay": relay, "code": code, "message": message}
        if key is not None:
            failure["producer_id"], failure["payload_id"] = key
            if local:
                self.failed.add(key)
        self.failures.append(failure)

    def report(self, relay: str) -> dict[str, Any]:
        """The flush report: payloads, bytes, timings, children and every failure."""
        elapsed = None if self.last_applied_at is None else self.last_applied_at - self.started_at
        return {
            "relay": relay,
            "transfer_id": self.transfer_id,
            "state": self.state,
            "applied": len(self.results),
            "duplicates": self.duplicates,
            "bytes_received": self.bytes_received,
            "bytes_forwarded": self.bytes_forwarded,
            "apply_s": self.apply_s,
            "elapsed_s": elapsed,
            "children": {a: vars(c) for a, c in self.children.items()},
            "failures": list(self.failures),
        }


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

    def open(self, transfer_id: str, target: int | None) -> TransferRecord:
        """The open record of ``transfer_id``, opening it if no other transfer is open.

        A payload against another base is not refused here: the relay still forwards it to
        its subtree, and the receiver refuses to apply it (STALE_BASE).

        Raises:
            StaleTransferError: the transfer is finished, or ``target`` does not advance.
            TransferConflictError: another transfer is open, or another target.
        """
        finished = self._finished.get(transfer_id)
        if finished is not None:
            raise StaleTransferError(f"transfer {transfer_id} is already {finished.state}")
        if target is not None and self.version is not None and target <= self.version:
            raise StaleTransferError(
                f"transfer {transfer_id} targets version {target}, relay holds {self.version}"
            )
        current = self.current
        if current is None:
            self.current = TransferRecord(transfer_id, target)
            return self.current
        if current.transfer_id != transfer_id:
            raise TransferConflictError(
                f"transfer {current.transfer_id} is still open; {transfer_id} must wait"
            )
        if target is not None and current.target not in (None, target):
            raise TransferConflictError(
                f"transfer {transfer_id} targets {target} and {current.target}"
            )
        current.target = current.target if target is None else target
        return current

    def finish(self, transfer_id: str, state: str, version: int | None) -> None:
        """Close ``transfer_id`` as ``state`` ("committed" or "aborted")."""
        record = self.record(transfer_id) or TransferRecord(transfer_id, None)
        record.state = state
        if self.current is record:
            self.current = None
        self._finished[transfer_id] = record
        self._finished.move_to_end(transfer_id)
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)
        self.version = version
