"""The group the participants are in (:class:`FormedGroup`), and how the controller forms it,
rebuilds it over the survivors and knows when it is stale (:class:`GroupFormation`).

Forming a group asks the engines for their geometry and trainer rank 0 for its state, plans
membership, agrees on the backend from every member's device, compares the plan digests every
member computed before any rendezvous (a mismatch never leaves peers waiting in one), then has
every member join a fresh rendezvous within the deadline.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from refit_core import GeometryMismatchError, RefitAbortedError
from refit_core.backend import CollectiveSenderSpec, Deadline, Gathered, Participant, gather
from refit_nccl.controller.failures import Failures
from refit_nccl.controller.membership import Membership, plan_membership
from refit_nccl.controller.options import CollectiveOptions
from refit_nccl.controller.waits import Waits, abort_members, time_left
from refit_nccl.group.devices import DeviceReport, choose_backend
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Backend
from refit_nccl.roles.contract import (
    CollectiveEngineRole,
    CollectiveMemberRole,
    CollectiveTrainerRole,
    JoinRequest,
    ShardMap,
    StateItems,
)

__all__ = ["FormedGroup", "GroupFormation"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FormedGroup:
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

    def abort(self, cause: str) -> None:
        """Ask every member to abort this group; never waits."""
        abort_members(self.name, self.members.values(), cause)


class GroupFormation:
    """Forms the collective group and keeps track of it: built, stale, or invalidated.

    Args:
        trainers: the trainer ranks, rank 0 first (rank 0 sends).
        shards: returns the engine shards now (called at every (re)build and staleness
            check, so restarted workers are seen).
        rendezvous: returns a fresh ``(host, port)`` on trainer rank 0's host per group.
        options: the synchronizer's tuning.
        waits: how long to wait for the participants.
        failures: builds the error of a failed step.
    """

    def __init__(
        self,
        trainers: Sequence[Participant[CollectiveTrainerRole]],
        shards: Callable[[], ShardMap],
        rendezvous: Callable[[], tuple[str, int]],
        options: CollectiveOptions,
        waits: Waits,
        failures: Failures,
    ) -> None:
        self._trainers = tuple(trainers)
        self._shards = shards
        self._rendezvous = rendezvous
        self._options = options
        self._waits = waits
        self._failures = failures
        self._counter = itertools.count()
        self.group: FormedGroup | None = None
        self._stale_reason: str | None = None

    def usable(self) -> FormedGroup:
        """The current group; RefitAbortedError if it is stale or not built."""
        group = self.group
        if group is None or self._stale_reason is not None:
            reason = self._stale_reason or "no group"
            raise RefitAbortedError(
                f"the communicator is stale ({reason}); call reconcile_communicator()"
            )
        return group

    def is_stale(self) -> bool:
        """Whether the group failed, or the shards changed since it was built."""
        group = self.group
        return self._stale_reason is not None or (
            group is not None and self._shard_keys() != group.seen
        )

    def invalidate(self, group: FormedGroup, cause: str) -> None:
        """Mark the communicator stale and abort its group everywhere."""
        self._stale_reason = cause
        group.abort(cause)

    def invalidate_current(self, cause: str) -> None:
        """:meth:`invalidate` the current group, if there is one."""
        if self.group is not None:
            self.invalidate(self.group, cause)

    def reconcile(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        """Rebuild over every shard but ``absent_shards``; nothing to do when the group is
        current and has just those absent."""
        group = self.group
        if group is not None and not self.is_stale() and absent_shards == group.absent:
            logger.info("reconcile: membership unchanged, nothing to do")
            return
        if group is not None:
            self.invalidate(group, "reconciling")
        self.build(absent_shards, deadline)

    def build(self, absent: frozenset[int], deadline: Deadline) -> None:
        """Form a new group of the trainers and every shard but ``absent``.

        Raises:
            GeometryMismatchError: the engines declare different geometries, or the
                participants planned different transfers.
            RefitError: a participant failed or did not answer in time.
        """
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
            self._waits.control_s(deadline),
        )
        if not planned.ok:
            raise self._failures.error("planning the transfer", planned, deadline)
        _require_one_digest(planned)
        name = f"{self._options.group_name}-{next(self._counter)}"
        host, port = self._rendezvous()
        left = time_left(deadline, f"joining group {name}")
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

        def abort_joining(cause: str) -> None:
            abort_members(name, members.values(), cause)

        gathered = self._waits.collective(calls, deadline, abort_joining)
        if not gathered.ok:
            abort_joining("join failed")
            raise self._failures.error(f"joining group {name}", gathered, deadline)
        seen = {i: tuple(w.key for w in ws) for i, ws in everyone.items()}
        digest = _require_one_digest(gathered)
        engines_by_rank = tuple(by_rank[rank] for rank in sorted(by_rank))
        self.group = FormedGroup(
            name, backend, membership, members, engines_by_rank, absent, seen, digest
        )
        self._stale_reason = None

    def _shard_keys(self) -> dict[int, tuple[Hashable, ...]]:
        return {index: tuple(w.key for w in ws) for index, ws in self._shards().items()}

    def _agree_backend(
        self, members: Iterable[Participant[CollectiveMemberRole]], deadline: Deadline
    ) -> Backend:
        """The backend every member can join, from the device each one reports."""
        members = list(members)
        gathered = gather(
            {p: p.call(CollectiveMemberRole.refit_device) for p in members},
            self._waits.control_s(deadline),
        )
        if not gathered.ok:
            raise self._failures.error("asking the members for their devices", gathered, deadline)
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
            self._waits.control_s(deadline),
        )
        if not gathered.ok:
            raise self._failures.error("asking the engines for their geometry", gathered, deadline)
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
        gathered = gather({sender: asked}, self._waits.control_s(deadline))
        if not gathered.ok:
            raise self._failures.error(f"asking {sender.label} for its state", gathered, deadline)
        return asked.result()


def _require_one_digest(gathered: Gathered) -> str:
    """The plan digest every participant reported; GeometryMismatchError naming who differs."""
    by_digest: dict[str, list[str]] = {}
    for participant, digest in gathered.results.items():
        by_digest.setdefault(digest, []).append(participant.label)
    if len(by_digest) != 1:
        groups = "; ".join(f"{d[:16]}...: {', '.join(who)}" for d, who in by_digest.items())
        raise GeometryMismatchError(f"participants planned different transfers: {groups}")
    return next(iter(by_digest))
