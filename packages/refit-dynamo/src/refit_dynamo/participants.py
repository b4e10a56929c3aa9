"""A Dynamo fleet as the engine side of refit-nccl's :class:`CollectiveWeightSynchronizer`.

Each engine rank of each worker is one participant playing refit-nccl's
:class:`~refit_nccl.CollectiveEngineRole`, so the synchronizer plans ranks as usual. One admin
call drives all of a worker's ranks, so the worker's local rank 0 makes the calls
(:mod:`refit_dynamo.transactions`; every call runs on a thread of its own, so no Ray cluster
is needed) and its other ranks answer at once.
"""

from __future__ import annotations

import logging
import time

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec, InFlight, LocalParticipant, Participant
from refit_dynamo.channel import DynamoRefitChannel
from refit_dynamo.protocol import init_payload
from refit_dynamo.transactions import flush_worker, join_worker, update_worker
from refit_nccl import CollectiveEngineRole
from refit_nccl.backend import JoinRequest, StateItems, TransferPlan, TransferStats

__all__ = ["DynamoRankEndpoint", "DynamoRankParticipant", "dynamo_shards"]

logger = logging.getLogger(__name__)


class DynamoRankEndpoint(CollectiveEngineRole):
    """Engine rank ``local_rank`` of Dynamo worker ``index`` of ``channel``, playing the engine
    role through the worker's admin routes (each call blocks; :class:`DynamoRankParticipant`
    runs it on a thread).

    The commit flushes the worker's cache (pause with ``clear_cache``, then resume). An abort
    can only be logged: refit cannot abort the communicator inside a Dynamo worker.
    """

    def __init__(self, channel: DynamoRefitChannel, index: int, local_rank: int) -> None:
        worker = channel.workers[index]
        self.label = (
            worker.instance_id if local_rank == 0 else f"{worker.instance_id}/rank{local_rank}"
        )
        self._channel = channel
        self._index = index
        self._local_rank = local_rank
        self._plan: TransferPlan | None = None
        self._in_flight = InFlight()

    @property
    def drives(self) -> bool:
        """Whether this rank makes the worker's admin calls (local rank 0)."""
        return self._local_rank == 0

    def refit_geometry(self) -> CollectiveSenderSpec:
        """The geometry the worker's vLLM receives with."""
        return self._channel.sender_spec

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of the plan for ``state``."""
        return self._plan_for(state, geometry).digest

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        if geometry != self._channel.sender_spec:
            raise GeometryMismatchError(
                f"{self.label}: vLLM receives with {self._channel.sender_spec}, "
                f"the plan uses {geometry}"
            )
        return TransferPlan.build(dict(state), geometry)

    def refit_join(self, request: JoinRequest) -> str:
        """Join the group (local rank 0 asks the worker to); the plan digest."""
        plan = self._plan = self._plan_for(request.state, request.geometry)
        if not self.drives:
            return plan.digest
        self._channel.prepare(dict(request.state))
        group = request.group
        payload = init_payload(group.host, group.port, group.rank, group.world_size)
        with self._in_flight:
            join_worker(self._channel, self._index, payload)
        return plan.digest

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Receive one refit (local rank 0 drives the worker's update transaction)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{self.label}: refit_transfer before refit_join")
        started = time.monotonic()
        sizes = (len(plan.buckets), plan.wire_bytes, plan.dense_bytes)
        if self.drives:
            with self._in_flight:
                update_worker(self._channel, self._index, version)
        return TransferStats.since(started, *sizes)

    def refit_commit(self, version: int) -> int:
        """Flush the worker's cache (local rank 0); the version."""
        if self.drives:
            flush_worker(self._channel, self._index)
        return version

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Log that a join or update still running cannot be aborted (nothing else to do)."""
        if self._in_flight:
            logger.warning(
                "%s: its join or update is still running and refit cannot abort the "
                "communicator inside a Dynamo worker (%s); the worker may stay wedged until it "
                "is re-initialized or restarted",
                self.label,
                cause,
            )


class DynamoRankParticipant(LocalParticipant[CollectiveEngineRole]):
    """A :class:`DynamoRankEndpoint` as the controller reaches it (each call on a thread); its
    key is the worker's endpoint and the rank, so a restarted worker is seen."""

    def __init__(self, channel: DynamoRefitChannel, index: int, local_rank: int) -> None:
        rank = DynamoRankEndpoint(channel, index, local_rank)
        super().__init__(rank, rank.label, key=(channel.workers[index], local_rank))
        self.rank = rank


def dynamo_shards(
    channel: DynamoRefitChannel,
) -> dict[int, list[Participant[CollectiveEngineRole]]]:
    """Shard index -> participants (one per engine rank) of every worker of ``channel``.

    Raises:
        FleetChangedError: the channel's ``validate_workers`` sees another fleet.
    """
    channel.check_membership()
    return {
        index: [
            DynamoRankParticipant(channel, index, rank) for rank in range(channel.engine_world_size)
        ]
        for index in range(len(channel.workers))
    }
