"""One typed error for a collective refit's failed calls (:class:`Failures`): what happened and
to whom first, each engine's state after it, and what recovers it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from refit_core import (
    DeadlineTooShortError,
    EngineHealth,
    EngineReport,
    EngineState,
    EngineStatus,
    FleetStatus,
    GeometryMismatchError,
    Recovery,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
)
from refit_core.backend import Deadline, Gathered, Participant
from refit_nccl.controller.probes import StatusProbe, died, engine_status, one_line
from refit_nccl.roles.contract import CollectiveTrainerRole, ShardMap

__all__ = ["Failures"]

_FAILURE_PROBE_S = 0.25
"""How long a failed refit waits for the engines' statuses (they answer within milliseconds
unless frozen)."""


class Failures:
    """Builds the error of a failed refit, build or commit.

    Args:
        shards: the engine shards now.
        probe: asks the engines for their status after a failed refit.
        sender: trainer rank 0 (its error's progress measures a deadline too short).
        refit_timeout_s: the deadline of one refit (None: disarmed).
        version: the version the engines served before the refit.
    """

    def __init__(
        self,
        shards: Callable[[], ShardMap],
        probe: StatusProbe,
        sender: Participant[CollectiveTrainerRole],
        refit_timeout_s: float | None,
        version: Callable[[], int],
    ) -> None:
        self._shards = shards
        self._probe = probe
        self._sender = sender
        self._refit_timeout_s = refit_timeout_s
        self._version = version

    def error(
        self,
        what: str,
        gathered: Gathered,
        deadline: Deadline,
        *,
        target: int | None = None,
        started: float | None = None,
    ) -> RefitError:
        """One typed error for failed calls: what happened and to whom first, each engine's
        state after it (asked of every engine when ``target``, the version the refit was
        writing, is given), what recovers it; the first underlying error chained.

        A lost participant (dead, or silent past the deadline) makes it a
        ``RefitTimeoutError``; a refit that ran out of time while every participant was
        alive and every engine answers a ``DeadlineTooShortError`` (``Recovery.FIX``)."""
        shard_of = {w: i for i, ws in self._shards().items() for w in ws}
        culprits = _culprits(gathered)
        first, cause = culprits[0] if culprits else (None, None)
        headline = f"{what} failed"
        if first is not None:
            headline += f" on {first.label}: {one_line(cause)}"
        others = len(culprits) - 1
        if others > 0:
            headline += f" (and {others} more)"
        engines: list[EngineReport] = []
        silent = set(gathered.missing)
        if target is not None:
            # Every engine is asked, those that did not answer the refit too: a survivor
            # still inside its transfer answers its status at once; a frozen one does not
            # (its probe is kept short: the error is due at the deadline and its grace).
            wait_s = min(self._probe.probe_s, _FAILURE_PROBE_S)
            answered = self._probe.ask(list(shard_of), wait_s=wait_s)
            fleet = FleetStatus.of(engine_status(shard_of[w], w, answered) for w in shard_of)
            silent = {w for w in gathered.missing if w not in answered.results}
            engines = _merged(
                [_engine_report(e, target, self._version()) for e in fleet.engines],
                _reported_engines(gathered),
            )
            headline += f"; engines: {_states(engines)}"
        elif culprits:
            engines = [
                EngineReport(shard_of.get(p), p.label, EngineState.UNKNOWN, None, one_line(e))
                for p, e in culprits
                if p in shard_of
            ]
            engines = _merged(engines, _reported_engines(gathered))
        wedged = [p.label for p in gathered.missing if p in silent]
        lost = bool(gathered.missing) or any(died(e) for e in gathered.errors.values())
        timeouts = all(
            isinstance(e, RefitTimeoutError | RefitAbortedError) for e in gathered.errors.values()
        )
        error: RefitError
        if isinstance(cause, GeometryMismatchError):
            error = GeometryMismatchError(headline, engines=engines)
        elif (
            target is not None
            and started is not None
            and self._refit_timeout_s is not None
            and deadline.expired()
            and not lost
            and timeouts
            and all(e.state is not EngineState.UNKNOWN for e in engines)
        ):
            sender = gathered.errors.get(self._sender)
            error = DeadlineTooShortError.measured(
                what,
                deadline_s=self._refit_timeout_s,
                elapsed_s=time.monotonic() - started,
                progress=sender.progress if isinstance(sender, RefitError) else None,
                engines=engines,
            )
        elif (
            lost
            or deadline.expired()
            or any(isinstance(e, TimeoutError) for e in gathered.errors.values())
        ):
            error = RefitTimeoutError(headline, wedged_workers=wedged, engines=engines)
        else:
            error = RefitError(
                headline, recovery=Recovery.RECOVER, wedged_workers=wedged, engines=engines
            )
        error.__cause__ = cause
        return error


def _culprits(gathered: Gathered) -> list[tuple[Participant[Any], BaseException | None]]:
    """Who failed, the likely root cause first: a participant's own failure (a dead actor,
    a refused geometry), then the silent ones (frozen or wedged), then the peers that only
    timed out or were aborted because of them."""

    def rank(error: BaseException | None) -> int:
        if error is None:
            return 1
        if isinstance(error, RefitAbortedError):
            return 4
        if isinstance(error, RefitTimeoutError):
            return 3
        return 2 if isinstance(error, RefitError) else 0

    failed: list[tuple[Participant[Any], BaseException | None]] = [
        *gathered.errors.items(),
        *((p, None) for p in gathered.missing),
    ]
    return sorted(failed, key=lambda item: rank(item[1]))


def _engine_report(engine: EngineStatus, target: int, previous: int) -> EngineReport:
    if engine.health is EngineHealth.UNREACHABLE:
        return EngineReport(engine.shard, engine.worker, EngineState.UNKNOWN, None, engine.detail)
    if engine.health is EngineHealth.CLOSED:
        return EngineReport(engine.shard, engine.worker, EngineState.CLOSED, None, engine.detail)
    state = EngineState.NEW if engine.version == target else EngineState.OLD
    if engine.version not in (target, previous):
        state = EngineState.UNKNOWN
    return EngineReport(engine.shard, engine.worker, state, engine.version)


def _states(engines: Sequence[EngineReport]) -> str:
    by_state: dict[str, list[str]] = {}
    for engine in engines:
        by_state.setdefault(engine.state.value, []).append(engine.worker)
    return ", ".join(f"{state} {who}" for state, who in by_state.items()) or "none"


def _reported_engines(gathered: Gathered) -> list[EngineReport]:
    """The engine states the failed calls reported themselves (a vLLM engine's workers know
    whether its model was written; one report per engine: its workers repeat it)."""
    reports: dict[tuple[int | None, str], EngineReport] = {}
    for error in gathered.errors.values():
        for report in getattr(error, "engines", ()):
            reports.setdefault((report.shard, report.worker), report)
    return list(reports.values())


def _merged(fleet: list[EngineReport], reported: list[EngineReport]) -> list[EngineReport]:
    """The fleet's reports, those of a shard (or label) whose engine reported itself replaced
    by that report: an engine knows whether its model was written (a vLLM engine that staged
    the refit serves the old version although its workers' receivers began)."""
    shards = {e.shard for e in reported if e.shard is not None}
    workers = {e.worker for e in reported}
    kept = [e for e in fleet if e.shard not in shards and e.worker not in workers]
    return sorted([*kept, *reported], key=lambda e: (e.shard is None, e.shard or 0, e.worker))
