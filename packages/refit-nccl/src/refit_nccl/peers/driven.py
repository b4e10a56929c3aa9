"""Engine ranks that refit drives through the engine's own calls, as collective participants.

A Dynamo worker (its admin routes) and an unmodified vLLM engine (vLLM's weight-sync surface)
run no refit endpoint: one call reaches every rank of the engine, which joins the trainer's
group and receives by itself. Each engine rank is still one participant, so the synchronizer
plans ranks as usual; local rank 0 makes the engine's calls and the other ranks answer at
once. refit cannot abort the communicator inside such an engine: an abort is only logged, and
an engine that does not answer by the deadline is named wedged.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Hashable

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec, InFlight, LocalParticipant
from refit_nccl.group.devices import DeviceReport
from refit_nccl.roles.contract import (
    CollectiveEngineRole,
    JoinRequest,
    StateItems,
    WorkerRefitStatus,
)
from refit_nccl.transfer.plan import TransferPlan
from refit_nccl.transfer.stats import TransferStats

__all__ = ["DrivenRankEndpoint", "DrivenRankParticipant"]

logger = logging.getLogger(__name__)


class DrivenRankEndpoint(CollectiveEngineRole):
    """Rank ``local_rank`` of an engine that refit drives through the engine's own calls,
    playing :class:`~refit_nccl.roles.contract.CollectiveEngineRole` (each call blocks;
    :class:`DrivenRankParticipant` runs it on a thread of its own).

    A subclass says how the engine joins, updates and commits.

    Args:
        label: how errors name the engine (rank ``r > 0`` is ``label/rank{r}``).
        local_rank: this rank within the engine.
        geometry: the packing geometry the engine receives with.
    """

    engines = "an engine"
    """What the engine is, for messages."""

    def __init__(self, label: str, local_rank: int, geometry: CollectiveSenderSpec) -> None:
        self.label = label if local_rank == 0 else f"{label}/rank{local_rank}"
        self._local_rank = local_rank
        self._geometry = geometry
        self._plan: TransferPlan | None = None
        self._in_flight = InFlight()

    @property
    def key(self) -> Hashable:
        """The engine and the rank within it."""
        return (self._engine_key(), self._local_rank)

    @property
    def drives(self) -> bool:
        """Whether this rank makes the engine's calls (local rank 0)."""
        return self._local_rank == 0

    # -- what a subclass says ----------------------------------------------------------

    @abstractmethod
    def _engine_key(self) -> Hashable:
        """Identity of the engine: a restarted one has another key."""

    @abstractmethod
    def _device_report(self) -> DeviceReport:
        """Where the engine receives and which backends it can join."""

    @abstractmethod
    def _join_engine(self, request: JoinRequest) -> None:
        """Have the engine join ``request.group`` (blocks until it has)."""

    @abstractmethod
    def _update_engine(self, version: int) -> None:
        """Have the engine receive one transfer and finish its update (blocks until done)."""

    def _commit_engine(self, version: int) -> None:
        """After every engine finished: drop caches computed with older weights."""

    # -- the role ----------------------------------------------------------------------

    def refit_device(self) -> DeviceReport:
        """Where the engine receives."""
        return self._device_report()

    def refit_geometry(self) -> CollectiveSenderSpec:
        """The geometry the engine receives with."""
        return self._geometry

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of the plan for ``state``."""
        return self._plan_for(state, geometry).digest

    def refit_join(self, request: JoinRequest) -> str:
        """Join the group (local rank 0 asks the engine to); the plan digest."""
        plan = self._plan = self._plan_for(request.state, request.geometry)
        if self.drives:
            with self._in_flight:
                self._join_engine(request)
        return plan.digest

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Receive one refit (local rank 0 drives the engine's update)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{self.label}: refit_transfer before refit_join")
        started = time.monotonic()
        if self.drives:
            with self._in_flight:
                self._update_engine(version)
        return TransferStats.since(started, len(plan.buckets), plan.wire_bytes, plan.dense_bytes)

    def refit_commit(self, version: int) -> int:
        """Drop the engine's stale caches (local rank 0); the version."""
        if self.drives:
            self._commit_engine(version)
        return version

    def refit_status(self) -> WorkerRefitStatus:
        """Not known: the engine reports no refit state of its own.

        Raises:
            NotImplementedError: always (the fleet status names the engine unreachable).
        """
        raise NotImplementedError(f"{self.engines} has no refit_status")

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Log that a join or update still running cannot be aborted (nothing else to do)."""
        if self._in_flight:
            logger.warning(
                "%s: its join or update is still running and refit cannot abort the "
                "communicator inside %s (%s); it may stay wedged until its weight transfer "
                "is re-initialized or it is restarted",
                self.label,
                self.engines,
                cause,
            )

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        if geometry != self._geometry:
            raise GeometryMismatchError(
                f"{self.label}: receives with {self._geometry}, the plan uses {geometry}"
            )
        return TransferPlan.build(dict(state), geometry)


class DrivenRankParticipant(LocalParticipant[CollectiveEngineRole]):
    """A :class:`DrivenRankEndpoint` as the controller reaches it (each call on a thread);
    its key is the engine's and the rank's, so a restarted engine is seen."""

    def __init__(self, rank: DrivenRankEndpoint) -> None:
        super().__init__(rank, rank.label, key=rank.key)
        self.rank = rank
