"""A trainer rank's endpoint (:class:`TrainerEndpoint`): rank 0 broadcasts the policy's weights."""

from __future__ import annotations

import logging

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec, Deadline, PolicyLike
from refit_core.sources import ShardedWeightSource
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.devices import DeviceType
from refit_nccl.roles.contract import CollectiveTrainerRole, JoinRequest, StateItems
from refit_nccl.roles.member import MemberEndpoint
from refit_nccl.transfer.broadcast import receive_packed, send_packed
from refit_nccl.transfer.plan import TransferPlan
from refit_nccl.transfer.stats import TransferStats

__all__ = ["TrainerEndpoint"]

logger = logging.getLogger(__name__)


class TrainerEndpoint(MemberEndpoint, CollectiveTrainerRole):
    """A trainer rank: rank 0 broadcasts the policy's weights, other trainer ranks receive
    and discard them (a broadcast needs every member).

    A sharded source (:class:`~refit_core.sources.ShardedWeightSource`) runs gathers on every
    trainer rank: only its sending rank joins the refit group, as rank 0, and every other
    rank drives ``iter_buckets()`` beside the refit; such a rank asking to join is refused.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
        device: where the policy's tensors live; None: this process's device.
    """

    def __init__(self, policy: PolicyLike, device: DeviceType | None = None) -> None:
        super().__init__(device)
        self._policy = policy

    def refit_join(self, request: JoinRequest) -> str:
        """See :meth:`MemberEndpoint.refit_join`; refuses a non-sending rank of a sharded source.

        Raises:
            GeometryMismatchError: this rank is not rank 0 and its source is sharded.
        """
        if request.group.rank and isinstance(self._policy.weight_source(), ShardedWeightSource):
            raise GeometryMismatchError(
                f"{request.group.label}: a sharded source gathers on every trainer rank, so only "
                "its sending rank joins the refit group; drive iter_buckets() on the others"
            )
        return super().refit_join(request)

    def refit_state(self) -> StateItems:
        """The state this trainer sends, in transfer order."""
        return tuple(self._policy.weight_source().state_dict_info().items())

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        # The state is trainer rank 0's own; the sender checks every tensor against the plan.
        return TransferPlan.build(dict(state), geometry)

    def _transfer(
        self, group: AbortableProcessGroup, plan: TransferPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        if group.rank == 0:
            source = self._policy.weight_source()
            tensors = ((item.name, item.tensor) for item in source.iter_tensors())
            stats = send_packed(group, plan, tensors, deadline, staging=self._staging)
            logger.info("%s: sent version %d in %.3f s", group.spec.label, version, stats.total_s)
            return stats
        return receive_packed(group, plan, lambda _: None, deadline, staging=self._staging)
