"""Trainer rank 0 for receivers that speak vLLM's native weight-transfer protocol.

vLLM's receiver (what a Dynamo worker runs) joins from ``init_info`` alone (address, port,
rank offset, world size), warms the group up with a one-element all-reduce, and plans from
the update info it is sent. So, unlike refit-nccl's ``TrainerEndpoint``, this trainer runs
no plan-digest handshake, and its group's store keys use one fixed prefix
(:data:`PEER_GROUP_NAME`) that the receiver can know; each group still meets on a fresh port.
"""

from __future__ import annotations

import dataclasses
import logging

from refit_core import CollectiveSenderSpec, Deadline
from refit_core.protocols import PolicyLike
from refit_nccl import (
    AbortableProcessGroup,
    GroupSpec,
    JoinRequest,
    StagingBuffers,
    TransferPlan,
    TransferStats,
    send_packed,
)
from refit_nccl.endpoint import StateItems
from refit_nccl.peer import PeerTrainer

__all__ = ["PEER_GROUP_NAME", "VllmPeerTrainer"]

logger = logging.getLogger(__name__)

PEER_GROUP_NAME = "vllm-weight-transfer"
"""Store-key prefix of every group shared with vLLM-protocol receivers."""


class VllmPeerTrainer(PeerTrainer[TransferPlan]):
    """The sending trainer rank (rank 0) of a refit into vLLM-protocol receivers: packed
    buckets, in a group whose store keys use :data:`PEER_GROUP_NAME`.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
    """

    engines = "a vLLM-protocol"

    def __init__(self, policy: PolicyLike) -> None:
        super().__init__(policy)
        self._staging = StagingBuffers()

    def _build_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        return TransferPlan.build(dict(state), geometry)

    def _group_spec(self, request: JoinRequest) -> GroupSpec:
        return dataclasses.replace(request.group, name=PEER_GROUP_NAME)

    def _send(
        self, group: AbortableProcessGroup, plan: TransferPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        tensors = ((t.name, t.tensor) for t in self._policy.weight_source().iter_tensors())
        stats = send_packed(group, plan, tensors, deadline, staging=self._staging)
        logger.info("sent version %d in %.3f s", version, stats.total_s)
        return stats
