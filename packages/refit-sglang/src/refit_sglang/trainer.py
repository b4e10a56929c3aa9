"""Trainer rank 0 of a disaggregated SGLang refit: hosts the weight-update group and
broadcasts each tensor of each bucket while the engines receive it."""

from __future__ import annotations

import dataclasses
import logging
import time

from refit_core import ProtocolError
from refit_core.backend import CollectiveSenderSpec, Deadline
from refit_nccl.backend import (
    AbortableProcessGroup,
    GroupSpec,
    JoinRequest,
    PeerTrainer,
    TransferStats,
)
from refit_sglang.plan import DistributedPlan, StateItems

__all__ = ["SGLangPeerTrainer"]

logger = logging.getLogger(__name__)


class SGLangPeerTrainer(PeerTrainer[DistributedPlan]):
    """The sending trainer rank (rank 0) of a refit into SGLang engines: one broadcast per
    tensor, bucket by bucket, as ``update_weights_from_distributed`` receives them.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
    """

    engines = "an SGLang"

    def _build_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> DistributedPlan:
        return DistributedPlan.build(state, geometry)

    def _group_spec(self, request: JoinRequest) -> GroupSpec:
        """SGLang's engines join with ``init_custom_process_group``: its store keys, no
        warm-up (:mod:`refit_nccl.group.rendezvous`, ``"sglang"``)."""
        return dataclasses.replace(request.group, rendezvous="sglang")

    def _send(
        self, group: AbortableProcessGroup, plan: DistributedPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        started = time.monotonic()
        tensors = iter(self._policy.weight_source().iter_tensors())
        for bucket in plan.buckets:
            for name, _ in bucket:
                sent = next(tensors, None)
                if sent is None or sent.name != name:
                    raise ProtocolError(f"the source yielded {sent and sent.name!r}, plan {name!r}")
                tensor = sent.tensor.to(group.device, non_blocking=False).contiguous()
                group.broadcast(tensor, 0, deadline)
        stats = TransferStats.since(started, len(plan.buckets), plan.dense_bytes, plan.dense_bytes)
        logger.info("sent version %d (%d buckets) in %.3f s", version, stats.buckets, stats.total_s)
        return stats
