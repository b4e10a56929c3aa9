"""``CollectiveWeightSynchronizer``: packed broadcast from trainer rank 0 to every engine worker.

The controller never moves weights itself: it plans membership, hands each participant its
place in a fresh group (:mod:`~refit_nccl.controller.formation`), and waits on their futures
for at most the deadline plus a grace period (:mod:`~refit_nccl.controller.waits`). Each
participant enforces the deadline on its own calls, so a dead or frozen peer ends the refit on
every survivor; ``reconcile_communicator`` then rebuilds over the survivors (and admits
restarted shards) with a fresh rendezvous. Refits stream into the engines here, or are staged
beside them (:mod:`~refit_nccl.controller.staging`); a failure is one typed error naming each
engine's state (:mod:`~refit_nccl.controller.failures`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from refit_core import (
    FleetStatus,
    RefitResult,
    StagedRefit,
    WeightSynchronizer,
    WorkerOutcome,
)
from refit_core.backend import Deadline, Participant, gather, probe_timeout_s
from refit_nccl.controller.failures import Failures
from refit_nccl.controller.formation import GroupFormation
from refit_nccl.controller.membership import Membership
from refit_nccl.controller.options import CollectiveOptions
from refit_nccl.controller.probes import StatusProbe, engine_status
from refit_nccl.controller.staging import Staging
from refit_nccl.controller.waits import Waits, time_left
from refit_nccl.group.traits import Backend
from refit_nccl.roles.contract import (
    CollectiveEngineRole,
    CollectiveMemberRole,
    CollectiveTrainerRole,
    ShardMap,
)
from refit_nccl.transfer.stats import TransferStats

__all__ = ["CollectiveWeightSynchronizer"]

logger = logging.getLogger(__name__)


class CollectiveWeightSynchronizer(WeightSynchronizer):
    """Refit over a collective: vLLM (and the reference engine) on separate GPUs or hosts.

    ``sync_weights`` streams each bucket into the engines. ``stage_weights`` moves the whole
    refit into a host copy beside every engine (engines keep serving, never paused) and
    ``commit_weights`` writes it into every engine at once; staging needs every engine
    participant to be a :class:`~refit_nccl.roles.contract.CollectiveStagingRole`.

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
        options = options or CollectiveOptions()
        if options.communicator_in_child and options.backend == "nccl":
            raise ValueError("communicator_in_child needs the gloo backend")
        self._trainers = tuple(trainers)
        self._shards = shards
        self._waits = Waits(options)
        self._probe = StatusProbe(
            probe_timeout_s(options.status_timeout_s, refit_timeout_s, name="status_timeout_s")
        )
        self._failures = Failures(
            shards, self._probe, self._trainers[0], refit_timeout_s, lambda: self.version
        )
        self._formation = GroupFormation(
            self._trainers, shards, rendezvous, options, self._waits, self._failures
        )
        self._staging = Staging(type(self).__name__, self._formation, self._waits, self._failures)

    @property
    def membership(self) -> Membership | None:
        """Who is in the current group (None before the first build)."""
        group = self._formation.group
        return group.membership if group else None

    @property
    def backend(self) -> Backend | None:
        """The current group's backend, chosen from its members' devices (None before the
        first build)."""
        group = self._formation.group
        return group.backend if group else None

    # -- hooks -------------------------------------------------------------------------

    def _init_communicator(self, deadline: Deadline) -> None:
        self._formation.build(frozenset(), deadline)

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        group = self._formation.usable()
        started = time.monotonic()
        what = f"refit to version {version}"
        left = time_left(deadline, what)
        gathered = self._waits.collective(
            {
                p: p.call(CollectiveMemberRole.refit_transfer, version, left)
                for p in group.members.values()
            },
            deadline,
            group.abort,
        )
        moved = time.monotonic()
        if not gathered.ok:
            self._formation.invalidate(group, f"{what} failed")
            raise self._failures.error(what, gathered, deadline, target=version, started=started)
        committed = gather(
            {p: p.call(CollectiveEngineRole.refit_commit, version) for p in group.engines},
            self._waits.control_s(deadline),
        )
        if not committed.ok:
            if committed.missing:
                self._formation.invalidate(group, "engines did not answer the commit")
            raise self._failures.error(
                f"commit of version {version}", committed, deadline, target=version
            )
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
        return self._staging.stage(version, deadline)

    def _commit_staged(self, staged: StagedRefit, deadline: Deadline) -> RefitResult:
        return self._staging.commit(staged, deadline)

    def _abort_staged(self, staged: StagedRefit, deadline: Deadline) -> None:
        self._staging.abort(staged, deadline)

    def _is_stale(self) -> bool:
        return self._formation.is_stale()

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        self._formation.reconcile(absent_shards, deadline)

    def _shutdown(self) -> None:
        self._formation.invalidate_current("synchronizer shut down")
        for participant in self._trainers:
            participant.close()

    # -- fleet status ------------------------------------------------------------------

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """Every engine worker's status, all asked at once (see :class:`StatusProbe`)."""
        workers = [(i, w) for i, ws in self._shards().items() for w in ws]
        answered = self._probe.ask([w for _, w in workers])
        return FleetStatus.of(engine_status(i, w, answered) for i, w in workers)

    def live_shards(self) -> frozenset[int] | None:
        group = self._formation.group
        return None if group is None else frozenset(group.membership.shard_indices)
