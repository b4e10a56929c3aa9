"""The ``WeightSynchronizer`` ABC: one public template method per operation, one hook per backend."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import ClassVar, TypeVar

from refit_core.deadline import Deadline, checked_timeout_s
from refit_core.errors import (
    EngineReport,
    EngineState,
    RefitError,
    RefitTimeoutError,
    SynchronizerClosedError,
)
from refit_core.fleet import EngineHealth, FleetStatus
from refit_core.staging import StagedRefit
from refit_core.types import RefitResult, WeightVersion

__all__ = ["RecoveryReport", "WeightSynchronizer"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class RecoveryReport:
    """What :meth:`WeightSynchronizer.recover` found and did.

    Attributes:
        before: the fleet as it answered first.
        dropped_shards: shards left out of the communicator (they did not answer).
        resync: the dense refit that brought the live engines to one version (None when
            they already served one version, that of the synchronizer).
        after: the fleet once recovered.
    """

    before: FleetStatus
    dropped_shards: tuple[int, ...]
    resync: RefitResult | None
    after: FleetStatus


class WeightSynchronizer(ABC):
    """Moves the trainer's weights into the inference engines, one versioned refit at a time.

    Public methods validate, time, log and wrap errors; backends implement the ``_``-prefixed
    hooks. Every refit gets a fresh :class:`Deadline` from ``refit_timeout_s`` (None disarms),
    which hooks pass down to each network or collective call. A synchronizer is not
    re-entrant: calls are serialized by an internal lock.
    """

    supports_staging: ClassVar[bool] = False
    """Whether the row implements the two phases (:meth:`stage_weights`, :meth:`commit_weights`)."""

    def __init__(self, *, refit_timeout_s: float | None = None) -> None:
        """Raises :class:`InvalidTimeoutError` for a ``refit_timeout_s`` that is not None
        or a positive finite number (the rule of every public entry point)."""
        self.refit_timeout_s = checked_timeout_s("refit_timeout_s", refit_timeout_s)
        self._version = WeightVersion(0)
        self._high_water = WeightVersion(0)
        self._staged: StagedRefit | None = None
        self._initialized = False
        self._closed = False
        self._lock = threading.RLock()

    # -- public template methods -------------------------------------------------------

    @property
    def version(self) -> int:
        """The weight version the engines serve after the last successful refit."""
        return self._version.value

    @property
    def high_water_mark(self) -> int:
        """The highest version this synchronizer ever tried, or its fleet ever began or
        served: every new version is above it, so no version is used for two sets of
        weights (a failed refit's version is not tried again)."""
        return self._high_water.value

    def init_communicator(self) -> None:
        """Set up the transport (groups, sockets, handles); idempotent."""
        with self._lock:
            self._require_open()
            if self._initialized:
                return
            started = time.monotonic()
            deadline = self._deadline()
            self._run_hook("init_communicator", lambda: self._init_communicator(deadline))
            self._initialized = True
            logger.info(
                "%s: communicator ready in %.3f s", type(self).__name__, time.monotonic() - started
            )
            self._adopt_fleet_version(deadline)

    def sync_weights(self, version: int | None = None) -> RefitResult:
        """Run one refit to ``version`` (default: one above :attr:`high_water_mark`). Its
        ``total_s`` is the whole call, and ``timings_s["connect"]`` the part spent setting up
        the communicator (a new synchronizer's first refit) before the backend's phases.

        Raises:
            ValueError: ``version`` is not above :attr:`high_water_mark` (it was used).
            RefitTimeoutError: the refit passed ``refit_timeout_s``; the communicator is stale.
            RefitError: any other failure, with the backend's error as its cause.
        """
        with self._lock:
            called = time.monotonic()
            self._require_open()
            self._require_nothing_staged()
            self.init_communicator()  # first: a new synchronizer adopts the fleet's version
            target, before = self._claim(version)
            deadline = self._deadline()
            started = time.monotonic()
            logger.info("%s: refit to version %d", type(self).__name__, target.value)
            result = self._run_claimed(
                f"refit to version {target.value}",
                before,
                lambda: self._sync_weights(target.value, deadline),
            )
            if result.version != target.value:
                raise RefitError(
                    f"backend reported version {result.version}, expected {target.value}"
                )
            self._version = target
            # The whole call: the communicator set up (a new synchronizer's first refit) too.
            result = replace(
                result,
                timings_s={**result.timings_s, "connect": started - called},
                total_s=time.monotonic() - called,
            )
            logger.info(
                "%s: version %d in %.3f s (%d wire bytes of %d dense)",
                type(self).__name__,
                target.value,
                result.total_s,
                result.wire_bytes,
                result.dense_bytes,
            )
            return result

    def stage_weights(self, version: int | None = None) -> StagedRefit:
        """Move and verify ``version`` (default: one above :attr:`high_water_mark`) on every
        engine, beside the version it serves, without changing what any engine serves.

        Nothing is committed anywhere unless every engine staged it; a failure here leaves
        every engine serving the old version, never paused.

        Raises:
            NotImplementedError: the row cannot stage (``supports_staging`` is False).
            ValueError: ``version`` is not above :attr:`high_water_mark` (it was used).
            RefitError: a refit is already staged, or staging failed (nothing changed).
        """
        with self._lock:
            self._require_open()
            self._require_staging()
            self._require_nothing_staged()
            self.init_communicator()  # first: a new synchronizer adopts the fleet's version
            target, before = self._claim(version)
            deadline = self._deadline()
            logger.info("%s: staging version %d", type(self).__name__, target.value)
            staged = self._run_claimed(
                f"staging version {target.value}",
                before,
                lambda: self._stage_weights(target.value, deadline),
            )
            if staged.version != target.value:
                raise RefitError(f"backend staged version {staged.version}, not {target.value}")
            self._staged = staged
            return staged

    def commit_weights(self, staged: StagedRefit) -> RefitResult:
        """Serve ``staged`` on every engine: each pauses at its next step boundary (requests
        in flight are kept), applies the staged bytes, drops its prefix cache, sets the
        version and resumes.

        The point of no return: an engine that fails or dies here is closed (it generates
        nothing) and named in the error, while the others serve the new version; the
        synchronizer's version moves to ``staged.version`` either way, and the next refit
        (or :meth:`recover`) resyncs or drops the failed engines.

        Raises:
            RefitError: ``staged`` is not the pending staging, or an engine failed to commit.
        """
        with self._lock:
            self._require_open()
            self._require_pending(staged)
            self._staged = None
            self._version = WeightVersion(staged.version)
            deadline = self._deadline()
            return self._run_hook(
                f"commit of version {staged.version}",
                lambda: self._commit_staged(staged, deadline),
            )

    def abort_weights(self, staged: StagedRefit) -> None:
        """Drop ``staged`` on every engine; what they serve does not change.

        Raises:
            RefitError: ``staged`` is not the pending staging.
        """
        with self._lock:
            self._require_open()
            self._require_pending(staged)
            self._staged = None
            deadline = self._deadline()
            self._run_hook(
                f"abort of staged version {staged.version}",
                lambda: self._abort_staged(staged, deadline),
            )

    @property
    def staged(self) -> StagedRefit | None:
        """The staged refit awaiting its commit or abort, if any."""
        return self._staged

    def status(self) -> FleetStatus:
        """Every engine as it reports itself: health, the version it serves, anything staged,
        the highest version it ever began, and which shards the communicator leaves out.

        Works before the first refit and while the communicator is broken: it asks every
        engine at once, each within a short probe timeout the row derives from
        ``refit_timeout_s`` (one that does not answer in time is ``unreachable``), so it
        takes about one probe timeout, not the deadline, when an engine is frozen.

        Raises:
            NotImplementedError: the row cannot ask its engines.
        """
        with self._lock:
            self._require_open()
            return self._status(self._deadline())

    def wait_for_switch(
        self, result: RefitResult, *, timeout_s: float | None = None, poll_s: float = 0.5
    ) -> FleetStatus:
        """Wait until every engine of ``result.engines_to_switch`` serves ``result.version``
        (asking the fleet every ``poll_s``, as :meth:`status` does); at once when none is
        left to switch.

        Args:
            result: what :meth:`sync_weights` or :meth:`commit_weights` returned.
            timeout_s: the longest wait (default: ``refit_timeout_s``; None then: no limit).

        Returns:
            The fleet as it answered last.

        Raises:
            RefitTimeoutError: an engine still does not serve the version; the error names it.
            NotImplementedError: the row cannot ask its engines.
        """
        waiting = set(result.engines_to_switch)
        deadline = Deadline.after(self.refit_timeout_s if timeout_s is None else timeout_s)
        while True:
            fleet = self.status()
            serving = {e.worker for e in fleet.engines if e.version == result.version}
            waiting -= serving
            if not waiting:
                return fleet
            if deadline.expired():
                raise RefitTimeoutError(
                    f"engines {sorted(waiting)} do not serve version {result.version} yet "
                    f"({fleet.describe()})"
                )
            time.sleep(min(poll_s, deadline.remaining_s() or poll_s))

    def recover(self) -> RecoveryReport:
        """Bring the fleet back to one version after any failure, as its error advised.

        Asks every engine (:meth:`status`), rebuilds the communicator without the engines
        that do not answer (and with the left-out ones that answer again), finishes
        transfers a fault left open, and, when the live engines are closed, disagree or
        serve another version than this synchronizer, runs a dense refit of the trainer's
        current weights to a new version above :attr:`high_water_mark`. A pending staging
        is aborted first. Each step has the refit's deadline.

        Raises:
            RefitTimeoutError: no engine answered (``Recovery.RECOVER``: try again later).
            RefitError: a step failed (the fleet is then as :meth:`status` says).
        """
        with self._lock:
            self._require_open()
            deadline = self._deadline()
            staged, self._staged = self._staged, None
            if staged is not None:
                logger.warning(
                    "%s: dropping staged version %d", type(self).__name__, staged.version
                )
                self._run_hook(
                    f"abort of staged version {staged.version}",
                    lambda: self._abort_staged(staged, deadline),
                )
            before = self._status(deadline)
            dropped = before.shards(EngineHealth.UNREACHABLE)
            if before.engines and set(dropped) == {e.shard for e in before.engines}:
                raise RefitTimeoutError(
                    f"no engine answered ({before.describe()}): nothing to recover onto yet",
                    engines=[
                        EngineReport(e.shard, e.worker, EngineState.UNKNOWN, None, e.detail)
                        for e in before.engines
                    ],
                )
            logger.info("%s: recovering from %s", type(self).__name__, before.describe())
            self._run_hook(
                "reconcile_communicator",
                lambda: self._reconcile_communicator(frozenset(dropped), deadline),
            )
            self._initialized = True
            self._run_hook("closing open transfers", lambda: self._close_open_transfers(deadline))
            live = self._live(self._status(deadline))
            resync: RefitResult | None = None
            if not live.consistent or live.agreed_version != self.version:
                logger.info(
                    "%s: resyncing %s to version %d",
                    type(self).__name__,
                    live.describe(),
                    self.high_water_mark + 1,
                )
                resync = self.sync_weights()
            after = self._status(self._deadline())
            logger.info("%s: recovered: %s", type(self).__name__, after.describe())
            return RecoveryReport(before, dropped, resync, after)

    def is_stale(self) -> bool:
        """Whether the communicator must be rebuilt (``reconcile_communicator``) before a refit."""
        with self._lock:
            self._require_open()
            return self._is_stale()

    def reconcile_communicator(self, absent_shards: Collection[int] = ()) -> None:
        """Rebuild the communicator over the engine shards not in ``absent_shards``.

        A no-op when nothing changed and the communicator is healthy.
        """
        with self._lock:
            self._require_open()
            absent = frozenset(absent_shards)
            if any(s < 0 for s in absent):
                raise ValueError(f"shard indices must be >= 0, got {sorted(absent)}")
            self._run_hook(
                "reconcile_communicator",
                lambda: self._reconcile_communicator(absent, self._deadline()),
            )
            self._initialized = True

    def shutdown(self) -> None:
        """Release every resource; idempotent. Later calls raise SynchronizerClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            logger.info("%s: shutting down", type(self).__name__)
            self._shutdown()

    def __enter__(self) -> WeightSynchronizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- hooks ------------------------------------------------------------------------

    @abstractmethod
    def _init_communicator(self, deadline: Deadline) -> None:
        """Build the transport; called once before the first refit and never after shutdown."""

    @abstractmethod
    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        """Move the weights, verify them, commit ``version`` on every engine."""

    def _is_stale(self) -> bool:
        """Whether the communicator needs a rebuild; False for transports without one."""
        return False

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        """Rebuild over survivors. Transports without membership refuse absent shards."""
        if absent_shards:
            raise NotImplementedError(
                f"{type(self).__name__} has no membership to reconcile (absent {sorted(absent_shards)})"
            )

    def _stage_weights(self, version: int, deadline: Deadline) -> StagedRefit:
        """Move and verify ``version`` beside what every engine serves (rows that stage)."""
        raise NotImplementedError(f"{type(self).__name__} cannot stage a refit")

    def _commit_staged(self, staged: StagedRefit, deadline: Deadline) -> RefitResult:
        """Switch every engine to ``staged`` (rows that stage)."""
        raise NotImplementedError(f"{type(self).__name__} cannot stage a refit")

    def _abort_staged(self, staged: StagedRefit, deadline: Deadline) -> None:
        """Drop ``staged`` everywhere (rows that stage)."""
        raise NotImplementedError(f"{type(self).__name__} cannot stage a refit")

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """Hook behind :meth:`status` and :meth:`recover`, for rows that can ask their
        engines: every engine of the fleet (shards left out of the communicator included),
        asked directly within ``deadline`` (it must work while the communicator is broken).
        Callers use :meth:`status`, which holds the synchronizer's lock and wraps errors.
        The default raises ``NotImplementedError``: ``status()`` and ``recover()`` say so."""
        raise NotImplementedError(f"{type(self).__name__} cannot report its fleet's status")

    def _close_open_transfers(self, deadline: Deadline) -> None:
        """Finish every transfer a fault left open on an engine (rows without any: nothing)."""
        return None

    def live_shards(self) -> frozenset[int] | None:
        """Hook for :meth:`recover`: the shards in the communicator now (None, the default:
        every shard of the fleet). Rows whose membership changes with
        ``_reconcile_communicator`` override it, so that ``recover()`` judges only the
        engines still refitted."""
        return None

    @abstractmethod
    def _shutdown(self) -> None:
        """Release resources; called at most once."""

    # -- helpers ----------------------------------------------------------------------

    def _deadline(self) -> Deadline:
        """The deadline of one public call, made here and passed to every hook it runs."""
        return Deadline.after(self.refit_timeout_s, name="refit_timeout_s")

    def _live(self, fleet: FleetStatus) -> FleetStatus:
        """``fleet`` without the shards left out of the communicator."""
        live = self.live_shards()
        if live is None:
            return fleet
        return FleetStatus(tuple(e for e in fleet.engines if e.shard in live))

    def _status(self, deadline: Deadline) -> FleetStatus:
        """The fleet's status with the left-out shards named; its high-water mark raises
        this synchronizer's."""
        fleet = self._run_hook("status", lambda: self.fleet_status(deadline))
        live = self.live_shards()
        if live is not None:
            fleet = FleetStatus.of(
                fleet.engines, (e.shard for e in fleet.engines if e.shard not in live)
            )
        self._raise_high_water(fleet.high_water_mark)
        return fleet

    def _raise_high_water(self, version: int | None) -> None:
        if version is not None and version > self._high_water.value:
            self._high_water = WeightVersion(version)

    def _claim(self, version: int | None) -> tuple[WeightVersion, WeightVersion]:
        """The version of the next refit (default: one above the high-water mark), recorded
        as used before anything moves; and the mark before it.

        Raises:
            ValueError: ``version`` is not above the high-water mark.
        """
        floor = max(self._version, self._high_water)
        target = floor.next() if version is None else WeightVersion(version)
        if target <= floor:
            raise ValueError(
                f"weight version must increase: {target.value} is not above "
                f"{floor.value}, the highest version used so far"
            )
        before, self._high_water = self._high_water, target
        return target, before

    def _run_claimed(self, what: str, before: WeightVersion, hook: Callable[[], _T]) -> _T:
        """Run a refit's hook; a refusal before anything moved (``NotImplementedError``,
        ``ValueError``) gives its version back."""
        try:
            return self._run_hook(what, hook)
        except (NotImplementedError, ValueError):
            self._high_water = before
            raise

    def _adopt_fleet_version(self, deadline: Deadline) -> None:
        """Start from the newest version the engines serve, and above the highest one any of
        them ever began (a restarted controller)."""
        try:
            fleet = self._status(deadline)
        except NotImplementedError:
            return
        except RefitError as exc:
            logger.warning("%s: could not ask the fleet its version: %s", type(self).__name__, exc)
            return
        newest = fleet.newest_version
        if len(fleet.serving()) > 1:
            logger.warning(
                "%s: the engines disagree (%s); starting above the newest",
                type(self).__name__,
                fleet.describe(),
            )
        if newest is not None and newest > self._version.value:
            logger.info("%s: the fleet serves version %d; adopting it", type(self).__name__, newest)
            self._version = WeightVersion(newest)
        logger.info(
            "%s: the fleet's high-water mark is %d; the next version is %d",
            type(self).__name__,
            self.high_water_mark,
            max(self.version, self.high_water_mark) + 1,
        )

    def _require_staging(self) -> None:
        if not self.supports_staging:
            raise NotImplementedError(
                f"{type(self).__name__} cannot stage a refit (no two-phase refit on this "
                "row); use sync_weights()"
            )

    def _require_nothing_staged(self) -> None:
        if self._staged is not None:
            raise RefitError(
                f"version {self._staged.version} is staged; commit_weights() or "
                "abort_weights() it first"
            )

    def _require_pending(self, staged: StagedRefit) -> None:
        if self._staged is None or self._staged.staging_id != staged.staging_id:
            pending = "none" if self._staged is None else f"version {self._staged.version}"
            raise RefitError(
                f"staged version {staged.version} is not the pending staging ({pending})"
            )

    def _require_open(self) -> None:
        if self._closed:
            raise SynchronizerClosedError(f"{type(self).__name__} was shut down")

    def _run_hook(self, what: str, hook: Callable[[], _T]) -> _T:
        try:
            return hook()
        except RefitError as exc:
            self._log_failure(what, exc)
            raise
        except TimeoutError as exc:
            error: RefitError = RefitTimeoutError(f"{what} timed out: {exc}")
            self._log_failure(what, exc, error)
            raise error from exc
        except (ValueError, NotImplementedError):
            raise
        except Exception as exc:
            error = RefitError(f"{what} failed: {type(exc).__name__}: {exc}")
            self._log_failure(what, exc, error)
            raise error from exc

    def _log_failure(self, what: str, exc: BaseException, raised: RefitError | None = None) -> None:
        """One WARNING line with the summary of the error the caller gets (a caller that
        handles it needs no traceback in its log); the traceback at DEBUG."""
        shown = raised or exc
        lines = str(shown).splitlines()
        logger.warning(
            "%s: %s failed: %s: %s",
            type(self).__name__,
            what,
            type(shown).__name__,
            lines[0] if lines else "",
        )
        logger.debug("%s: %s failed", type(self).__name__, what, exc_info=exc)
