"""A Dynamo fleet as the engine side of refit-nccl's :class:`CollectiveWeightSynchronizer`.

Each engine rank of each worker is one participant, so the synchronizer plans ranks as usual.
One admin call drives all of a worker's ranks, so the worker's local rank 0 makes the calls
(:mod:`refit_dynamo.transactions`, each on a thread of its own, so no Ray cluster is needed)
and its other ranks answer at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

from refit_core import CollectiveSenderSpec, GeometryMismatchError
from refit_dynamo.channel import DynamoRefitChannel
from refit_dynamo.protocol import init_payload
from refit_dynamo.transactions import flush_worker, join_worker, update_worker
from refit_nccl import JoinRequest, Participant, TransferPlan, TransferStats
from refit_nccl.endpoint import StateItems
from refit_nccl.futures import dispatch, done, in_thread, then

__all__ = ["DynamoRankParticipant", "StateItems", "dynamo_shards"]

logger = logging.getLogger(__name__)

_THREAD = "refit-dynamo"


class DynamoRankParticipant(Participant):
    """Engine rank ``local_rank`` of Dynamo worker ``index`` of ``channel``.

    Serves the engine calls of refit-nccl's synchronizer (``refit_geometry``, ``refit_plan``,
    ``refit_join``, ``refit_transfer``, ``refit_commit``, ``refit_abort``) through the
    worker's admin routes. The commit flushes the worker's cache (pause with ``clear_cache``,
    then resume). An abort can only be logged: refit cannot abort the communicator inside a
    Dynamo worker.
    """

    def __init__(self, channel: DynamoRefitChannel, index: int, local_rank: int) -> None:
        worker = channel.workers[index]
        label = worker.instance_id if local_rank == 0 else f"{worker.instance_id}/rank{local_rank}"
        super().__init__(label)
        self._channel = channel
        self._worker = worker
        self._local_rank = local_rank
        self._plan: TransferPlan | None = None
        self._in_flight: Future[Any] | None = None

    @property
    def key(self) -> Hashable:
        """The worker's endpoint and the rank within it."""
        return (self._worker, self._local_rank)

    @property
    def drives(self) -> bool:
        """Whether this rank makes the worker's admin calls (local rank 0)."""
        return self._local_rank == 0

    def close(self) -> None:
        """Nothing to release: the connections belong to the channel."""

    def call(self, method: str, *args: Any) -> Future[Any]:
        """Start ``method(*args)``; never blocks."""
        handlers: dict[str, Callable[..., Future[Any]]] = {
            "refit_geometry": lambda: done(self._channel.sender_spec),
            "refit_plan": lambda state, geometry: done(self._plan_for(state, geometry).digest),
            "refit_join": self._join,
            "refit_transfer": self._transfer,
            "refit_commit": self._commit,
            "refit_abort": self._abort,
        }
        return dispatch(handlers, method, args, "a Dynamo worker")

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        if geometry != self._channel.sender_spec:
            raise GeometryMismatchError(
                f"{self.label}: vLLM receives with {self._channel.sender_spec}, "
                f"the plan uses {geometry}"
            )
        return TransferPlan.build(dict(state), geometry)

    def _join(self, request: JoinRequest) -> Future[str]:
        plan = self._plan = self._plan_for(request.state, request.geometry)
        if not self.drives:
            return done(plan.digest)
        self._channel.prepare(dict(request.state))
        group = request.group
        payload = init_payload(
            group.host, group.port, group.rank, group.world_size, self._channel.sender_spec
        )
        self._in_flight = in_thread(
            join_worker, self._channel.admin, self._worker, payload, name=_THREAD
        )
        return then(self._in_flight, lambda _: plan.digest)

    def _transfer(self, version: int, timeout_s: float | None) -> Future[TransferStats]:
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{self.label}: refit_transfer before refit_join")
        started = time.monotonic()
        sizes = (len(plan.buckets), plan.wire_bytes, plan.dense_bytes)
        if not self.drives:
            return done(TransferStats.since(started, *sizes))
        info = self._channel.update_info
        if info is None:
            raise RuntimeError(f"{self.label}: the channel carries no update info")
        self._in_flight = in_thread(
            update_worker, self._channel.admin, self._worker, info, version, name=_THREAD
        )
        return then(self._in_flight, lambda _: TransferStats.since(started, *sizes))

    def _commit(self, version: int) -> Future[int]:
        if not self.drives:
            return done(version)
        flushed = in_thread(flush_worker, self._channel.admin, self._worker, name=_THREAD)
        return then(flushed, lambda _: version)

    def _abort(self, cause: str, *_: object) -> Future[None]:
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            logger.warning(
                "%s: its join or update is still running and refit cannot abort the "
                "communicator inside a Dynamo worker (%s); the worker may stay wedged until it "
                "is re-initialized or restarted",
                self.label,
                cause,
            )
        return done(None)


def dynamo_shards(channel: DynamoRefitChannel) -> dict[int, list[Participant]]:
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
