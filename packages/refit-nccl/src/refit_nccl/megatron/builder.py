"""The factory rows ``megatron.colocated.reshard`` and ``megatron.non-colocated.collective``.

Each process builds its own synchronizer (SPMD): ``policy`` and ``generation`` are
:class:`MegatronSide` s giving the whole layout of their side and, where this process holds a
rank of that side, its rank and shards (a process outside a side returns rank None and no
shards). ``train_cluster.get_master_address_and_port()`` must return the same address on every
process; it is called only when some copy crosses between processes. The processes agree on
the group's backend from the device of each one's shards (NCCL when all are on CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from refit_core.backend import RendezvousCluster, SynchronizerRequest
from refit_nccl.megatron.layout import ParamLayout
from refit_nccl.megatron.plan import ReshardPlan, plan_reshard
from refit_nccl.megatron.synchronizer import MegatronWeightSynchronizer

__all__ = ["MegatronSide", "build_collective_reshard", "build_colocated_reshard"]


@runtime_checkable
class MegatronSide(Protocol):
    """The trainer or the inference model, as one process sees it."""

    def megatron_layouts(self) -> Mapping[str, ParamLayout]:
        """Global parameter name -> layout over all ranks of this side."""
        ...

    def megatron_rank(self) -> int | None:
        """This process's rank on this side, or None if it holds none."""
        ...

    def megatron_shards(self) -> Mapping[str, torch.Tensor]:
        """This process's shards by global name (inference shards are written in place)."""
        ...


def build_colocated_reshard(request: SynchronizerRequest) -> MegatronWeightSynchronizer:
    """Builder of (megatron, colocated, reshard): source and destination rank ``r`` share a
    process, layouts that already match copy nothing."""
    return _build(request, colocated=True)


def build_collective_reshard(request: SynchronizerRequest) -> MegatronWeightSynchronizer:
    """Builder of (megatron, non-colocated, collective): trainer processes then inference
    processes in one group."""
    return _build(request, colocated=False)


def _build(request: SynchronizerRequest, *, colocated: bool) -> MegatronWeightSynchronizer:
    policy, generation = request.policy, request.generation
    if not isinstance(policy, MegatronSide) or not isinstance(generation, MegatronSide):
        raise ValueError(
            "policy and generation must provide megatron_layouts(), megatron_rank() and "
            "megatron_shards()"
        )
    plan = plan_reshard(
        policy.megatron_layouts(), generation.megatron_layouts(), colocated=colocated
    )
    process = _process(plan, policy.megatron_rank(), generation.megatron_rank())
    cluster = request.train_cluster
    return MegatronWeightSynchronizer(
        plan,
        process,
        policy.megatron_shards,
        generation.megatron_shards,
        cluster.get_master_address_and_port if isinstance(cluster, RendezvousCluster) else None,
        refit_timeout_s=request.refit_timeout_s,
    )


def _process(plan: ReshardPlan, source: int | None, destination: int | None) -> int:
    """This process's rank in the plan, from its ranks on each side."""
    ranks = {plan.process_of_source(source)} if source is not None else set()
    if destination is not None:
        ranks.add(plan.process_of_destination(destination))
    if len(ranks) != 1:
        raise ValueError(
            f"trainer rank {source} and inference rank {destination} do not name one process "
            f"(colocated={plan.colocated})"
        )
    return ranks.pop()
