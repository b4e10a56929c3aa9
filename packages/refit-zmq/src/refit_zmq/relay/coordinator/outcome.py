"""How a transfer ended, and the structured error of one that did not commit.

The error names what happened and to whom in its first clause, carries one
:class:`~refit_core.errors.EngineReport` per relay (its shard index, address, what it serves
now: ``old`` once it confirmed the rollback, ``new`` once it committed, ``unknown`` when it
could not be reached), the recovery the next refit needs, and chains the first underlying
error instead of concatenating texts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from refit_core import (
    ChecksumMismatchError,
    EngineReport,
    EngineState,
    GeometryMismatchError,
    Recovery,
    RefitError,
    RefitTimeoutError,
    StaleBaseError,
    VerificationError,
)
from refit_zmq.relay.wire.errors import TransferConflictError
from refit_zmq.relay.wire.reports import AbortReply, CommitReply, Failure, FlushReport

__all__ = ["TransferOutcome", "relay_error"]

_KINDS: tuple[tuple[frozenset[str], type[RefitError], Recovery], ...] = (
    (frozenset({"UNREACHABLE", "TIMEOUT", "DEADLINE"}), RefitTimeoutError, Recovery.RECOVER),
    (frozenset({"GEOMETRY", "TREE", "AUTH"}), GeometryMismatchError, Recovery.FIX),
    (frozenset({"STALE_BASE"}), StaleBaseError, Recovery.RESYNC),
    (frozenset({"VERIFICATION", "DIGEST"}), VerificationError, Recovery.RESYNC),
    (frozenset({"CHECKSUM"}), ChecksumMismatchError, Recovery.RETRY),
    (frozenset({"CONFLICT", "STALE_TRANSFER"}), TransferConflictError, Recovery.RECOVER),
)
"""Failure codes -> the error class and recovery they call for, the first match winning."""
_ORDER = (Recovery.RETRY, Recovery.RESYNC, Recovery.RECOVER, Recovery.FIX)


def _kind(codes: Sequence[str]) -> tuple[type[RefitError], Recovery]:
    for matched, kind, recovery in _KINDS:
        if any(code in matched for code in codes):
            return kind, recovery
    return RefitError, Recovery.RECOVER


@dataclass(frozen=True)
class TransferOutcome:
    """How a transfer ended.

    Attributes:
        transfer_id: the transfer.
        committed: the decision.
        reports: relay -> its flush report (relays that answered).
        failures: every failure: unreachable relays first, then what relays reported, then
            digest mismatches.
        decisions: relay -> its confirmation of the decision (COMMIT or ABORT reply).
        decision_errors: relay -> why it did not confirm the decision (in doubt until
            :meth:`~refit_zmq.relay.RelayCoordinator.close_open_transfers` reaches it, or it
            settles the transfer itself).
        causes: relay -> the error its FLUSH ended in (it did not answer).
    """

    transfer_id: str
    committed: bool
    reports: Mapping[str, FlushReport]
    failures: tuple[Failure, ...]
    decisions: Mapping[str, CommitReply | AbortReply] = field(default_factory=dict)
    decision_errors: Mapping[str, RefitError] = field(default_factory=dict)
    causes: Mapping[str, RefitError] = field(default_factory=dict)

    def engines(self, shards: Mapping[str, int]) -> tuple[EngineReport, ...]:
        """One report per relay of ``shards`` (address -> shard index), in shard order."""
        reasons: dict[str, str] = {}
        for failure in self.failures:
            reasons.setdefault(failure.relay, f"{failure.code}: {failure.message}")
        reports = []
        for address, shard in sorted(shards.items(), key=lambda item: item[1]):
            decided = self.decisions.get(address)
            if decided is None:
                state, version = EngineState.UNKNOWN, None
            else:
                committed = isinstance(decided, CommitReply)
                state = EngineState.NEW if committed else EngineState.OLD
                version = decided.version
            reason = reasons.get(address)
            if decided is None and reason is None:
                error = self.decision_errors.get(address)
                reason = None if error is None else f"decision not confirmed: {error}"
            reports.append(EngineReport(shard, address, state, version, reason))
        return tuple(reports)

    def error(self, shards: Mapping[str, int], *, target: int | None = None) -> RefitError:
        """The structured error of a transfer that did not commit (see the module docstring).

        Args:
            shards: relay address -> its shard index.
            target: the version the refit was for (named in the message).
        """
        engines = self.engines(shards)
        kind, recovery = _kind([f.code for f in self.failures])
        if any(e.state is EngineState.UNKNOWN for e in engines):
            recovery = max(recovery, Recovery.RECOVER, key=_ORDER.index)
        what = f"refit to version {target}" if target is not None else "transfer"
        first = self.failures[0] if self.failures else None
        if first is None:
            head = "no relay reported a failure, but not every relay was complete"
        else:
            shard = shards.get(first.relay)
            named = f"relay {first.relay}" + ("" if shard is None else f" (shard {shard})")
            head = f"{named} {first.code}: {first.message}"
        others = sorted({f.relay for f in self.failures[1:]} - {first.relay if first else ""})
        more = f"; failures also on {len(others)} other relays" if others else ""
        text = f"{what} ({self.transfer_id}) aborted: {head}{more}"
        unknown = [e.worker for e in engines if e.state is EngineState.UNKNOWN]
        error = kind(text, recovery=recovery, engines=engines, wedged_workers=unknown)
        cause = next(iter(self.causes.values()), None)
        if cause is not None:
            error.__cause__ = cause
        return error


def relay_error(
    what: str,
    errors: Mapping[str, RefitError],
    shards: Mapping[str, int],
    versions: Mapping[str, int | None],
) -> RefitError:
    """The error of a request some relays did not answer (before any transfer began).

    Args:
        what: what was being done ("reading the relays' status").
        errors: relay -> the error its request ended in.
        shards: relay address -> shard index, for every relay.
        versions: relay -> the version it reported (relays that answered).
    """
    engines = tuple(
        EngineReport(
            shard,
            address,
            EngineState.UNKNOWN if address in errors else EngineState.OLD,
            versions.get(address),
            None if address not in errors else str(errors[address]),
        )
        for address, shard in sorted(shards.items(), key=lambda item: item[1])
    )
    failed = sorted(errors, key=lambda a: shards.get(a, len(shards)))
    named = ", ".join(f"{a} (shard {shards[a]})" if a in shards else a for a in failed)
    timeouts = all(isinstance(e, RefitTimeoutError) for e in errors.values())
    kind: type[RefitError] = RefitTimeoutError if timeouts else RefitError
    verb = "do not answer" if timeouts else "failed"
    error = kind(
        f"relays {named} {verb} ({what}); recover, or reconcile_communicator without them",
        recovery=Recovery.RECOVER,
        engines=engines,
        wedged_workers=failed,
    )
    error.__cause__ = errors[failed[0]]
    return error
