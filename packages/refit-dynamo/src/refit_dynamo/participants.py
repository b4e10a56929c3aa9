"""A Dynamo fleet as the engine side of refit-nccl's :class:`CollectiveWeightSynchronizer`.

Each engine rank of each worker is one participant playing refit-nccl's
:class:`~refit_nccl.CollectiveEngineRole`, so the synchronizer plans ranks as usual. One admin
call drives all of a worker's ranks, so the worker's local rank 0 makes the calls
(:mod:`refit_dynamo.transactions`; every call runs on a thread of its own, so no Ray cluster
is needed) and its other ranks answer at once.
"""

from __future__ import annotations

from collections.abc import Hashable

from refit_core.backend import Participant
from refit_dynamo.channel import DynamoRefitChannel
from refit_dynamo.protocol import init_payload
from refit_dynamo.transactions import flush_worker, join_worker, update_worker
from refit_nccl import CollectiveEngineRole
from refit_nccl.backend import DeviceReport, DrivenRankEndpoint, DrivenRankParticipant, JoinRequest

__all__ = ["DynamoRankEndpoint", "DynamoRankParticipant", "dynamo_shards"]


class DynamoRankEndpoint(DrivenRankEndpoint):
    """Engine rank ``local_rank`` of Dynamo worker ``index`` of ``channel``, playing the engine
    role through the worker's admin routes (refit-nccl's
    :class:`~refit_nccl.backend.DrivenRankEndpoint` serves the synchronizer's calls; each call
    blocks, :class:`DynamoRankParticipant` runs it on a thread).

    The commit flushes the worker's cache (pause with ``clear_cache``, then resume). Its device
    is the channel's (``device``): on CUDA the worker's vLLM receives over vLLM's own NCCL data
    plane, and the init and update info are built with the trainer's vLLM dataclasses
    (:mod:`refit_nccl.vllm_native`).
    """

    engines = "a Dynamo worker"

    def __init__(self, channel: DynamoRefitChannel, index: int, local_rank: int) -> None:
        super().__init__(channel.workers[index].instance_id, local_rank, channel.sender_spec)
        self._channel = channel
        self._worker = channel.workers[index]

    def _engine_key(self) -> Hashable:
        return self._worker

    def _device_report(self) -> DeviceReport:
        return DeviceReport.only(self._channel.device)

    def _join_engine(self, request: JoinRequest) -> None:
        group = request.group
        vllm_nccl = group.backend == "nccl"
        self._channel.prepare(dict(request.state), vllm_nccl=vllm_nccl)
        payload = init_payload(
            group.host,
            group.port,
            group.rank,
            group.world_size,
            self._channel.sender_spec,
            vllm_nccl=vllm_nccl,
        )
        join_worker(self._channel.admin, self._worker, payload)

    def _update_engine(self, version: int) -> None:
        info = self._channel.update_info
        if info is None:
            raise RuntimeError(f"{self.label}: the channel carries no update info")
        update_worker(self._channel.admin, self._worker, info, version)

    def _commit_engine(self, version: int) -> None:
        flush_worker(self._channel.admin, self._worker)


class DynamoRankParticipant(DrivenRankParticipant):
    """A :class:`DynamoRankEndpoint` as the controller reaches it (each call on a thread); its
    key is the worker's endpoint and the rank, so a restarted worker is seen."""

    def __init__(self, channel: DynamoRefitChannel, index: int, local_rank: int) -> None:
        super().__init__(DynamoRankEndpoint(channel, index, local_rank))


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
