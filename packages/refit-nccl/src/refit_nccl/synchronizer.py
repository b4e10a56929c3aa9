"""``CollectiveWeightSynchronizer``: packed broadcast from trainer rank 0 to every engine worker.

The controller never moves weights itself: it plans membership, hands each participant its
place in a fresh group, and waits on their futures for at most the deadline plus a grace
period. Each participant enforces the deadline on its own calls, so a dead or frozen peer
ends the refit on every survivor; ``reconcile_communicator`` then rebuilds over the
survivors (and admits restarted shards) with a fresh rendezvous.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

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
    RefitResult,
    RefitTimeoutError,
    StagedRefit,
    WeightSynchronizer,
    WorkerOutcome,
)
from refit_core.backend import (
    CollectiveSenderSpec,
    Deadline,
    Gathered,
    Participant,
    check_field_types,
    checked_buffer_size,
    gather,
    probe_timeout_s,
)
from refit_nccl.backends import Backend
from refit_nccl.broadcast import TransferStats
from refit_nccl.devices import DeviceReport, choose_backend
from refit_nccl.endpoint import CommitStats
from refit_nccl.endpoint import EngineStatus as WorkerStatus
from refit_nccl.group import DISARMED_TIMEOUT_S, GroupSpec
from refit_nccl.membership import Membership, plan_membership
from refit_nccl.roles import (
    CollectiveEngineRole,
    CollectiveMemberRole,
    CollectiveStagingRole,
    CollectiveTrainerRole,
    JoinRequest,
    StateItems,
)

__all__ = ["CollectiveOptions", "CollectiveWeightSynchronizer", "ShardMap"]

logger = logging.getLogger(__name__)

_FAILURE_PROBE_S = 0.25
"""How long a failed refit waits for the engines' statuses (they answer within milliseconds
unless frozen)."""

ShardMap = Mapping[int, Sequence[Participant[CollectiveEngineRole]]]
"""Engine shard index -> its workers, in local-rank order."""


@dataclass(frozen=True)
class CollectiveOptions:
    """Tuning of a :class:`CollectiveWeightSynchronizer`.

    Attributes:
        backend: communicator backend; None picks it at every (re)build from the devices
            every member reports (``nccl`` when all are on CUDA, ``gloo`` when all are on
            CPU; mixed devices are refused). A backend given here must suit every member.
        buffer_size_bytes: bucket size the deployment requires (``refit_buffer_size_gb``);
            engines declaring another size are refused. None accepts what they declare.
        control_timeout_s: bound of non-collective calls (geometry, state, commit).
        grace_s: how long past the deadline the controller waits for participants to report
            their own timeout before naming them wedged.
        settle_s: once the deadline has passed and a participant has failed, how much longer
            the controller waits for the others (they release by the deadline plus ~1 s).
        status_timeout_s: how long ``status()``, ``recover()`` and the engine states of a
            failure wait for each engine's status (every engine asked at once; one that does
            not answer is unreachable, and is not asked again while that call is pending).
            None derives it from the deadline: a tenth of ``refit_timeout_s``, within
            [1 s, 2 s] (2 s without a deadline). A value above a quarter of
            ``refit_timeout_s`` is refused when the synchronizer is built.
        group_name: prefix of each group's store keys; a counter makes every group unique.
        communicator_in_child: every participant runs its communicator in a child process
            that is killed at the deadline or on abort (``ChildProcessGroup``, gloo only),
            for a backend whose calls neither time out nor end on abort; each (re)build
            starts fresh children.
    """

    backend: Backend | None = None
    buffer_size_bytes: int | None = None
    control_timeout_s: float = 60.0
    grace_s: float = 5.0
    settle_s: float = 1.5
    status_timeout_s: float | None = None
    group_name: str = "refit"
    communicator_in_child: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.buffer_size_bytes is not None:
            checked_buffer_size(self.buffer_size_bytes, "CollectiveOptions.buffer_size_bytes")


@dataclass(frozen=True)
class _Group:
    """The group the participants are in now.

    ``seen`` holds the keys of every shard (absent ones included) when it was built: a
    change there (a restarted or new shard) makes the communicator stale.
    """

    name: str
    backend: Backend
    membership: Membership
    members: Mapping[int, Participant[CollectiveMemberRole]]
    engines: tuple[Participant[CollectiveEngineRole], ...]
    absent: frozenset[int]
    seen: Mapping[int, tuple[Hashable, ...]]
    digest: str


class CollectiveWeightSynchronizer(WeightSynchronizer):
    """Refit over a collective: vLLM (and the reference engine) on separate GPUs or hosts.

    ``sync_weights`` streams each bucket into the engines. ``stage_weights`` moves the whole
    refit into a host copy beside every engine (engines keep serving, never paused) and
    ``commit_weights`` writes it into every engine at once; staging needs every engine
    participant to be a :class:`~refit_nccl.roles.CollectiveStagingRole`.

    Args:
        trainers: the trainer ranks, rank 0 first (rank 0 sends).
        shards: returns the engine shards now (called at every (re)build and staleness check,
            so restarted workers are seen).
        rendezvous: returns a fresh ``(host, port)`` on trainer rank 0's host per group.
        refit_timeout_s: deadline of one refit (None disarms it).
        options: tuning.
    """

    supports_staging = True

    def __init__(
        self,
        trainers: Sequence[Participant[CollectiveTrainerRole]],
        shards: Callable[[], ShardMap],
        rendezvous: Callable[[], tuple[str, int]],
        *,
        refit_timeout_s: float | None = None,
        options: CollectiveOptions | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        if not trainers:
            raise ValueError("need at least one trainer rank")
        self._trainers = tuple(trainers)
        self._shards = shards
        self._rendezvous = rendezvous
        self._options = options or CollectiveOptions()
        if self._options.communicator_in_child and self._options.backend == "nccl":
            raise ValueError("communicator_in_child needs the gloo backend")
        self._counter = itertools.count()
        self._group: _Group | None = None
        self._stale_reason: str | None = None
        self._staged_on: dict[str, tuple[Participant[CollectiveStagingRole], ...]] = {}
        self._probe_s = probe_timeout_s(
            self._options.status_timeout_s, refit_timeout_s, name="status_timeout_s"
        )
        self._probes: dict[Hashable, Future[WorkerStatus]] = {}
        self._dead: dict[Hashable, BaseException] = {}

    @property
    def membership(self) -> Membership | None:
        """Who is in the current group (None before the first build)."""
        return self._group.membership if self._group else None

    @property
    def backend(self) -> Backend | None:
        """The current group's backend, chosen from its members' devices (None before the
        first build)."""
        return self._group.backend if self._group else None

    # -- hooks -------------------------------------------------------------------------

    def _init_communicator(self, deadline: Deadline) -> None:
        self._build(frozenset(), deadline)

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        group = self._usable_group()
        started = time.monotonic()
        what = f"refit to version {version}"
        left = _left(deadline, what)
        gathered = self._gather_collective(
            {
                p: p.call(CollectiveMemberRole.refit_transfer, version, left)
                for p in group.members.values()
            },
            deadline,
            group,
        )
        moved = time.monotonic()
        if not gathered.ok:
            self._invalidate(group, f"{what} failed")
            raise self._failure(what, gathered, deadline, target=version, started=started)
        committed = gather(
            {p: p.call(CollectiveEngineRole.refit_commit, version) for p in group.engines},
            self._control_wait_s(deadline),
        )
        if not committed.ok:
            if committed.missing:
                self._invalidate(group, "engines did not answer the commit")
            raise self._failure(f"commit of version {version}", committed, deadline, target=version)
        finished = time.monotonic()
        sender: TransferStats = gathered.results[group.members[0]]
        received: list[TransferStats] = [gathered.results[p] for p in group.engines]
        return RefitResult(
            version=version,
            timings_s={
                "transfer": moved - started,
                "commit": finished - moved,
                "pack": sender.pack_s,
                "send_wait": sender.wait_s,
                "load": max(s.consume_s for s in received),
                "receive_wait": max(s.wait_s for s in received),
            },
            total_s=finished - started,
            wire_bytes=sender.wire_bytes,
            dense_bytes=sender.dense_bytes,
            workers=tuple(WorkerOutcome(p.label, True, version) for p in group.engines),
        )

    def _stage_weights(self, version: int, deadline: Deadline) -> StagedRefit:
        group = self._usable_group()
        engines = self._staging_engines(group, deadline)
        started = time.monotonic()
        what = f"staging version {version}"
        left = _left(deadline, what)
        calls: dict[Participant[Any], Future[TransferStats]] = {
            p: p.call(CollectiveMemberRole.refit_transfer, version, left)
            for p in group.members.values()
            if p not in group.engines
        }
        calls.update({e: e.call(CollectiveStagingRole.refit_stage, version, left) for e in engines})
        gathered = self._gather_collective(calls, deadline, group)
        if not gathered.ok:
            self._invalidate(group, f"{what} failed")
            for engine in engines:
                engine.call(CollectiveStagingRole.refit_drop_staged, version)
            raise self._failure(what, gathered, deadline, target=version, started=started)
        sender: TransferStats = gathered.results[group.members[0]]
        received: list[TransferStats] = [gathered.results[e] for e in engines]
        staging_id = f"{group.name}/{version}/{uuid.uuid4().hex[:8]}"
        self._staged_on = {staging_id: engines}
        elapsed = time.monotonic() - started
        result = RefitResult(
            version=version,
            timings_s={
                "transfer": elapsed,
                "pack": sender.pack_s,
                "send_wait": sender.wait_s,
                "receive_wait": max(s.wait_s for s in received),
            },
            total_s=elapsed,
            wire_bytes=sender.wire_bytes,
            dense_bytes=sender.dense_bytes,
            workers=tuple(WorkerOutcome(p.label, True, None) for p in engines),
        )
        return StagedRefit(version, staging_id, result)

    def _commit_staged(self, staged: StagedRefit, deadline: Deadline) -> RefitResult:
        engines = self._staged_on.pop(staged.staging_id)
        version = staged.version
        started = time.monotonic()
        committed = gather(
            {e: e.call(CollectiveStagingRole.refit_commit_staged, version) for e in engines},
            self._control_wait_s(deadline),
        )
        if not committed.ok:
            if self._group is not None:
                self._invalidate(self._group, f"commit of version {version} failed")
            raise self._failure(f"commit of version {version}", committed, deadline, target=version)
        commit_s = time.monotonic() - started
        stats: list[CommitStats] = [committed.results[e] for e in engines]
        return RefitResult(
            version=version,
            timings_s={
                **staged.result.timings_s,
                "commit": commit_s,
                "pause": max(s.paused_s for s in stats),
            },
            total_s=staged.result.total_s + commit_s,
            wire_bytes=staged.result.wire_bytes,
            dense_bytes=staged.result.dense_bytes,
            workers=tuple(WorkerOutcome(e.label, True, version) for e in engines),
        )

    def _abort_staged(self, staged: StagedRefit, deadline: Deadline) -> None:
        engines = self._staged_on.pop(staged.staging_id)
        dropped = gather(
            {e: e.call(CollectiveStagingRole.refit_drop_staged, staged.version) for e in engines},
            self._control_wait_s(deadline),
        )
        if not dropped.ok:
            raise self._failure(f"abort of staged version {staged.version}", dropped, deadline)

    def _staging_engines(
        self, group: _Group, deadline: Deadline
    ) -> tuple[Participant[CollectiveStagingRole], ...]:
        """The group's engines as staging participants, once each said it can stage.

        Raises:
            NotImplementedError: an engine participant cannot stage (named by its type).
        """
        asked = gather(
            {e: e.call(CollectiveEngineRole.refit_status) for e in group.engines},
            self._control_wait_s(deadline),
        )
        cannot = [
            e
            for e in group.engines
            if isinstance(asked.errors.get(e), NotImplementedError)
            or (e in asked.results and not asked.results[e].can_stage)
        ]
        if cannot:
            who = ", ".join(f"{e.label} ({type(e).__name__})" for e in cannot)
            raise NotImplementedError(
                f"{type(self).__name__} cannot stage: these engine participants cannot ({who}); "
                "use sync_weights()"
            )
        if not asked.ok:
            raise self._failure("asking the engines whether they can stage", asked, deadline)
        # Each one said it serves CollectiveStagingRole's methods.
        return tuple(cast("Participant[CollectiveStagingRole]", e) for e in group.engines)

    def _usable_group(self) -> _Group:
        """The current group; RefitAbortedError if it is stale or not built."""
        group = self._group
        if group is None or self._stale_reason is not None:
            reason = self._stale_reason or "no group"
            raise RefitAbortedError(
                f"the communicator is stale ({reason}); call reconcile_communicator()"
            )
        return group

    def _is_stale(self) -> bool:
        group = self._group
        return self._stale_reason is not None or (
            group is not None and self._shard_keys() != group.seen
        )

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        group = self._group
        if group is not None and not self._is_stale() and absent_shards == group.absent:
            logger.info("reconcile: membership unchanged, nothing to do")
            return
        if group is not None:
            self._invalidate(group, "reconciling")
        self._build(absent_shards, deadline)

    def _shutdown(self) -> None:
        if self._group is not None:
            self._invalidate(self._group, "synchronizer shut down")
        for participant in self._trainers:
            participant.close()

    # -- internals ---------------------------------------------------------------------

    def _shard_keys(self) -> dict[int, tuple[Hashable, ...]]:
        return {index: tuple(w.key for w in ws) for index, ws in self._shards().items()}

    def _build(self, absent: frozenset[int], deadline: Deadline) -> None:
        everyone = {i: tuple(ws) for i, ws in self._shards().items()}
        shards = {i: ws for i, ws in everyone.items() if i not in absent}
        membership = plan_membership(len(self._trainers), {i: len(ws) for i, ws in shards.items()})
        engines = [w for i in membership.shard_indices for w in shards[i]]
        geometry = self._agree_geometry(engines, deadline)
        state = self._state(deadline)
        by_rank: dict[int, Participant[CollectiveEngineRole]] = {
            membership.shard(index).rank_of(local_rank): worker
            for index in membership.shard_indices
            for local_rank, worker in enumerate(shards[index])
        }
        members: dict[int, Participant[CollectiveMemberRole]] = dict(enumerate(self._trainers))
        members.update(by_rank)
        backend = self._agree_backend(members.values(), deadline)
        planned = gather(
            {p: p.call(CollectiveMemberRole.refit_plan, state, geometry) for p in members.values()},
            self._control_wait_s(deadline),
        )
        if not planned.ok:
            raise self._failure("planning the transfer", planned, deadline)
        _require_one_digest(planned)
        name = f"{self._options.group_name}-{next(self._counter)}"
        host, port = self._rendezvous()
        left = _left(deadline, f"joining group {name}")
        logger.info(
            "building group %s at %s:%d: %d trainers, shards %s (world %d)",
            name, host, port, membership.trainers, list(membership.shard_indices),
            membership.world_size,
        )  # fmt: skip
        calls = {
            participant: participant.call(
                CollectiveMemberRole.refit_join,
                JoinRequest(
                    GroupSpec(
                        host,
                        port,
                        rank,
                        membership.world_size,
                        backend,
                        name,
                        in_child=self._options.communicator_in_child,
                    ),
                    state,
                    geometry,
                    left,
                ),
            )
            for rank, participant in members.items()
        }
        gathered = self._gather_collective(calls, deadline, abort=(name, members.values()))
        if not gathered.ok:
            self._abort_members(name, members.values(), "join failed")
            raise self._failure(f"joining group {name}", gathered, deadline)
        seen = {i: tuple(w.key for w in ws) for i, ws in everyone.items()}
        digest = _require_one_digest(gathered)
        engines_by_rank = tuple(by_rank[rank] for rank in sorted(by_rank))
        self._group = _Group(
            name, backend, membership, members, engines_by_rank, absent, seen, digest
        )
        self._stale_reason = None

    def _agree_backend(
        self, members: Iterable[Participant[CollectiveMemberRole]], deadline: Deadline
    ) -> Backend:
        """The backend every member can join, from the device each one reports."""
        members = list(members)
        gathered = gather(
            {p: p.call(CollectiveMemberRole.refit_device) for p in members},
            self._control_wait_s(deadline),
        )
        if not gathered.ok:
            raise self._failure("asking the members for their devices", gathered, deadline)
        reports: dict[str, DeviceReport] = {p.label: gathered.results[p] for p in members}
        requested = self._options.backend or (
            "gloo" if self._options.communicator_in_child else None
        )
        backend = choose_backend(reports, requested)
        devices = sorted({r.device for r in reports.values()})
        logger.info("members report %s: backend %s", ", ".join(devices), backend)
        return backend

    def _agree_geometry(
        self, engines: Sequence[Participant[CollectiveEngineRole]], deadline: Deadline
    ) -> CollectiveSenderSpec:
        gathered = gather(
            {e: e.call(CollectiveEngineRole.refit_geometry) for e in engines},
            self._control_wait_s(deadline),
        )
        if not gathered.ok:
            raise self._failure("asking the engines for their geometry", gathered, deadline)
        declared: dict[CollectiveSenderSpec, list[str]] = {}
        for engine, spec in gathered.results.items():
            declared.setdefault(spec, []).append(engine.label)
        if len(declared) != 1:
            raise GeometryMismatchError(f"engines declare different geometries: {declared}")
        geometry = next(iter(declared))
        wanted = self._options.buffer_size_bytes
        if wanted is not None and wanted != geometry.buffer_size_bytes:
            raise GeometryMismatchError(
                f"refit_buffer_size_gb (or options.buffer_size_bytes) asks for {wanted} B "
                "buckets, the engines declared "
                f"{geometry.buffer_size_bytes} B"
            )
        return geometry

    def _state(self, deadline: Deadline) -> StateItems:
        """The state trainer rank 0 sends."""
        sender = self._trainers[0]
        asked = sender.call(CollectiveTrainerRole.refit_state)
        gathered = gather({sender: asked}, self._control_wait_s(deadline))
        if not gathered.ok:
            raise self._failure(f"asking {sender.label} for its state", gathered, deadline)
        return asked.result()

    def _invalidate(self, group: _Group, cause: str) -> None:
        """Mark the communicator stale and abort its group everywhere."""
        self._stale_reason = cause
        self._abort_members(group.name, group.members.values(), cause)

    @staticmethod
    def _abort_members(
        name: str, members: Iterable[Participant[CollectiveMemberRole]], cause: str
    ) -> None:
        """Ask every member to abort group ``name``; never waits (a frozen one never answers)."""
        for participant in members:
            participant.call(CollectiveMemberRole.refit_abort, cause, name)

    def _gather_collective(
        self,
        calls: Mapping[Participant[Any], Future[Any]],
        deadline: Deadline,
        group: _Group | None = None,
        *,
        abort: tuple[str, Iterable[Participant[CollectiveMemberRole]]] | None = None,
    ) -> Gathered:
        """Wait for collective calls, up to deadline + grace. The first failure aborts the
        group on every member at once (a dead peer ends the refit everywhere, not at the
        deadline); the rest then get ``settle_s`` to report."""
        target = abort or ((group.name, group.members.values()) if group else None)

        def abort_everyone(participant: Participant[Any], error: BaseException) -> None:
            if target is not None:
                cause = f"{participant.label} failed: {type(error).__name__}"
                logger.warning("collective call failed on %s; aborting the group", participant)
                self._abort_members(target[0], target[1], cause)

        remaining = deadline.remaining_s()
        settle = self._options.settle_s
        if remaining is None or deadline.at is None:
            return gather(
                calls,
                DISARMED_TIMEOUT_S + self._options.grace_s,
                settle_s=settle,
                on_failure=abort_everyone,
            )
        return gather(
            calls,
            remaining + self._options.grace_s,
            settle_at=deadline.at + settle,
            settle_s=settle,
            on_failure=abort_everyone,
        )

    # -- fleet status and failures -----------------------------------------------------

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """Every engine worker's status, all asked at once (see :meth:`_probe`)."""
        workers = [(i, w) for i, ws in self._shards().items() for w in ws]
        answered = self._probe([w for _, w in workers])
        return FleetStatus.of(_engine_status(i, w, answered) for i, w in workers)

    def _probe(
        self, workers: Sequence[Participant[CollectiveEngineRole]], wait_s: float | None = None
    ) -> Gathered:
        """Each worker's status within the probe timeout, all asked at once. A worker whose
        last status call is still unanswered (frozen) is not asked again, that call is
        awaited instead, so calls never pile up on it; a worker whose actor died is
        remembered (its death reported, not asked or logged again)."""
        calls: dict[Participant[Any], Future[WorkerStatus]] = {}
        for worker in workers:
            if worker.key in self._dead:
                continue
            pending = self._probes.get(worker.key)
            if pending is None or pending.done():
                pending = self._probes[worker.key] = worker.call(CollectiveEngineRole.refit_status)
            calls[worker] = pending
        answered = gather(calls, self._probe_s if wait_s is None else wait_s)
        for worker, error in answered.errors.items():
            if _died(error):
                logger.warning("%s died: %s", worker.label, _one_line(error))
                self._dead[worker.key] = error
                self._probes.pop(worker.key, None)
        for worker in workers:
            if worker.key in self._dead:
                answered.errors[worker] = self._dead[worker.key]
        return answered

    def live_shards(self) -> frozenset[int] | None:
        group = self._group
        return None if group is None else frozenset(group.membership.shard_indices)

    def _failure(
        self,
        what: str,
        gathered: Gathered,
        deadline: Deadline,
        *,
        target: int | None = None,
        started: float | None = None,
    ) -> RefitError:
        """One typed error for failed calls: what happened and to whom first, each engine's
        state after it, what recovers it; the first underlying error chained.

        A lost participant (dead, or silent past the deadline) makes it a
        ``RefitTimeoutError``; a refit that ran out of time while every participant was
        alive and every engine answers a ``DeadlineTooShortError`` (``Recovery.FIX``)."""
        shard_of = {w: i for i, ws in self._shards().items() for w in ws}
        culprits = _culprits(gathered)
        first, cause = culprits[0] if culprits else (None, None)
        headline = f"{what} failed"
        if first is not None:
            headline += f" on {first.label}: {_one_line(cause)}"
        others = len(culprits) - 1
        if others > 0:
            headline += f" (and {others} more)"
        engines: list[EngineReport] = []
        silent = set(gathered.missing)
        if target is not None:
            # Every engine is asked, those that did not answer the refit too: a survivor
            # still inside its transfer answers its status at once; a frozen one does not
            # (its probe is kept short: the error is due at the deadline and its grace).
            answered = self._probe(list(shard_of), wait_s=min(self._probe_s, _FAILURE_PROBE_S))
            fleet = FleetStatus.of(_engine_status(shard_of[w], w, answered) for w in shard_of)
            silent = {w for w in gathered.missing if w not in answered.results}
            engines = _merged(
                [_engine_report(e, target, self.version) for e in fleet.engines],
                _reported_engines(gathered),
            )
            headline += f"; engines: {_states(engines)}"
        elif culprits:
            engines = [
                EngineReport(shard_of.get(p), p.label, EngineState.UNKNOWN, None, _one_line(e))
                for p, e in culprits
                if p in shard_of
            ]
            engines = _merged(engines, _reported_engines(gathered))
        wedged = [p.label for p in gathered.missing if p in silent]
        lost = bool(gathered.missing) or any(_died(e) for e in gathered.errors.values())
        timeouts = all(
            isinstance(e, RefitTimeoutError | RefitAbortedError) for e in gathered.errors.values()
        )
        error: RefitError
        if isinstance(cause, GeometryMismatchError):
            error = GeometryMismatchError(headline, engines=engines)
        elif (
            target is not None
            and started is not None
            and self.refit_timeout_s is not None
            and deadline.expired()
            and not lost
            and timeouts
            and all(e.state is not EngineState.UNKNOWN for e in engines)
        ):
            sender = gathered.errors.get(self._trainers[0])
            error = DeadlineTooShortError.measured(
                what,
                deadline_s=self.refit_timeout_s,
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

    def _control_wait_s(self, deadline: Deadline) -> float:
        remaining = deadline.remaining_s()
        limit = self._options.control_timeout_s
        return limit if remaining is None else min(limit, remaining + self._options.grace_s)


def _died(error: BaseException) -> bool:
    """Whether a participant's call failed because its process is gone (Ray's
    ``ActorDiedError``): it will never answer again, and no retry brings it back."""
    return any(kind.__name__ == "ActorDiedError" for kind in type(error).__mro__)


def _left(deadline: Deadline, what: str) -> float | None:
    """What is left of ``deadline`` for ``what``; RefitTimeoutError if nothing is."""
    deadline.check(what)
    return deadline.remaining_s()


def _require_one_digest(gathered: Gathered) -> str:
    """The plan digest every participant reported; GeometryMismatchError naming who differs."""
    by_digest: dict[str, list[str]] = {}
    for participant, digest in gathered.results.items():
        by_digest.setdefault(digest, []).append(participant.label)
    if len(by_digest) != 1:
        groups = "; ".join(f"{d[:16]}...: {', '.join(who)}" for d, who in by_digest.items())
        raise GeometryMismatchError(f"participants planned different transfers: {groups}")
    return next(iter(by_digest))


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


def _one_line(error: BaseException | None) -> str:
    if error is None:
        return "no answer (wedged or dead)"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def _engine_status(
    shard: int, worker: Participant[CollectiveEngineRole], gathered: Gathered
) -> EngineStatus:
    label = worker.label
    if worker in gathered.missing or worker in gathered.errors:
        detail = _one_line(gathered.errors.get(worker))
        return EngineStatus(shard, label, EngineHealth.UNREACHABLE, detail=detail)
    status = gathered.results[worker]
    if status.closed:
        reason = status.abort_cause or "its weights changed since the last commit"
        return EngineStatus(
            shard, label, EngineHealth.CLOSED, detail=reason, began_version=status.began_version
        )
    return EngineStatus(
        shard,
        label,
        EngineHealth.SERVING,
        status.committed_version,
        status.staged_version,
        began_version=status.began_version,
    )


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
