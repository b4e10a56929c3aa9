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
import threading

from refit_core import CollectiveSenderSpec, Deadline, RefitAbortedError
from refit_core.protocols import PolicyLike
from refit_dynamo.participants import StateItems
from refit_nccl import (
    AbortableProcessGroup,
    JoinRequest,
    StagingBuffers,
    TransferPlan,
    TransferStats,
    send_packed,
)

__all__ = ["PEER_GROUP_NAME", "VllmPeerTrainer"]

logger = logging.getLogger(__name__)

PEER_GROUP_NAME = "vllm-weight-transfer"
"""Store-key prefix of every group shared with vLLM-protocol receivers."""


class VllmPeerTrainer:
    """The sending trainer rank (rank 0) of a refit into vLLM-protocol receivers.

    Serves the trainer calls of refit-nccl's synchronizer: ``refit_state``, ``refit_plan``,
    ``refit_join``, ``refit_transfer``, ``refit_abort``. Every group call runs under the
    remaining deadline.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
    """

    def __init__(self, policy: PolicyLike) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self._group: AbortableProcessGroup | None = None
        self._group_name: str | None = None
        self._plan: TransferPlan | None = None
        self._staging = StagingBuffers()

    def refit_state(self) -> StateItems:
        """The state this trainer sends, in transfer order."""
        return tuple(self._policy.weight_source().state_dict_info().items())

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of the plan for ``state`` and ``geometry``; joins nothing."""
        return TransferPlan.build(dict(state), geometry).digest

    def refit_join(self, request: JoinRequest) -> str:
        """Leave any previous group, host and join ``request.group``; the plan digest."""
        if request.group.rank != 0:
            raise ValueError("a vLLM-protocol refit has one trainer rank, the sender (rank 0)")
        with self._lock:
            self._leave("joining a new group")
            plan = TransferPlan.build(dict(request.state), request.geometry)
            group = AbortableProcessGroup(dataclasses.replace(request.group, name=PEER_GROUP_NAME))
            self._group, self._group_name = group, request.group.name
            group.connect(Deadline.after(request.timeout_s))
            self._plan = plan
            logger.info("%s: joined as the sender of %s", request.group.label, request.group.name)
            return plan.digest

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Broadcast the policy's current weights to every receiver."""
        with self._lock:
            group, plan = self._group, self._plan
            if group is None or plan is None:
                raise RefitAbortedError("not in a group: call refit_join first")
            tensors = ((t.name, t.tensor) for t in self._policy.weight_source().iter_tensors())
            stats = send_packed(
                group, plan, tensors, Deadline.after(timeout_s), staging=self._staging
            )
            logger.info("sent version %d in %.3f s", version, stats.total_s)
            return stats

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Abort the current group (only if it is ``group_name``, when given); never blocks."""
        group = self._group
        if group is not None and group_name in (None, self._group_name):
            group.abort(cause)

    def _leave(self, cause: str) -> None:
        if self._group is not None:
            self._group.abort(cause)
        self._group = self._group_name = self._plan = None
