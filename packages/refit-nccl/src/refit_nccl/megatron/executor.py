"""Run a :class:`ReshardPlan` over an :class:`~refit_nccl.AbortableProcessGroup`.

Every process walks the plan's copies in the same order and takes part only in its own:
a copy inside one process is a tensor copy (skipped when source and destination are the same
memory), otherwise the source process sends and the destination process receives. Walking one
global order never deadlocks: the earliest unfinished copy always has both its processes at it.
The group offers only blocking point-to-point calls (no batched or asynchronous send/recv), so
copies run one at a time; each call gets the refit's deadline, past which the group aborts
and the error propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from refit_core import RefitTimeoutError
from refit_core.backend import Deadline
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.megatron.plan import Copy, ReshardPlan

__all__ = ["ReshardStats", "execute_reshard"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardStats:
    """What one process did in a reshard (bytes along the copies' rows)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    copied_bytes: int = 0
    aliased_bytes: int = 0


def execute_reshard(
    plan: ReshardPlan,
    process: int,
    sources: Mapping[str, torch.Tensor],
    destinations: Mapping[str, torch.Tensor],
    deadline: Deadline,
    group: AbortableProcessGroup | None = None,
) -> ReshardStats:
    """Fill this process's ``destinations`` from the ``sources`` of all processes.

    Args:
        plan: the plan every process executes.
        process: this process's rank in the plan (and in ``group``).
        sources: this process's source shards by name (empty if it is no source rank).
        destinations: this process's destination shards by name, written in place.
        deadline: the refit's deadline.
        group: a connected group of at least :attr:`ReshardPlan.world_size` processes (its
            later ranks take no part); only needed when a copy of this process crosses to
            another.

    Raises:
        ValueError: the group or the local shards do not match the plan.
        RefitTimeoutError: a call passed the deadline or a peer was lost; the group is aborted.
        RefitAbortedError: the group was aborted.
    """
    me = process
    if group is not None and (group.rank != me or group.world_size < plan.world_size):
        raise ValueError(
            f"group rank {group.rank}/{group.world_size} cannot be process {me} of "
            f"{plan.world_size}"
        )
    _check_shards(plan, me, sources, destinations)
    if deadline.expired():
        raise RefitTimeoutError(f"process {me}: deadline passed before the reshard")
    stats = {"sent": 0, "received": 0, "copied": 0, "aliased": 0}
    for copy in plan.copies:
        src_proc = plan.process_of_source(copy.src)
        dst_proc = plan.process_of_destination(copy.dst)
        if me not in (src_proc, dst_proc):
            continue
        size = plan.copy_bytes(copy)
        if src_proc == dst_proc:
            source, target = (
                _rows(sources, plan, copy, True),
                _rows(destinations, plan, copy, False),
            )
            if source.data_ptr() == target.data_ptr() and source.stride() == target.stride():
                stats["aliased"] += size
            else:
                target.copy_(source)
                stats["copied"] += size
        elif group is None:
            raise ValueError(f"{copy.name}: copy {src_proc} -> {dst_proc} needs a group")
        elif me == src_proc:
            group.send(_rows(sources, plan, copy, True).contiguous(), dst_proc, deadline)
            stats["sent"] += size
        else:
            target = _rows(destinations, plan, copy, False)
            buffer = target if target.is_contiguous() else torch.empty_like(target)
            group.recv(buffer, src_proc, deadline)
            if buffer is not target:
                target.copy_(buffer)
            stats["received"] += size
    logger.debug("process %d: reshard done: %s", me, stats)
    return ReshardStats(stats["sent"], stats["received"], stats["copied"], stats["aliased"])


def _rows(
    tensors: Mapping[str, torch.Tensor], plan: ReshardPlan, copy: Copy, source: bool
) -> torch.Tensor:
    dim = plan.sources[copy.name].dim
    offset = copy.src_offset if source else copy.dst_offset
    return tensors[copy.name].narrow(dim, offset, len(copy.span))


def _check_shards(
    plan: ReshardPlan,
    me: int,
    sources: Mapping[str, torch.Tensor],
    destinations: Mapping[str, torch.Tensor],
) -> None:
    for side, layouts, tensors, rank in (
        ("source", plan.sources, sources, me if me < plan.source_world else None),
        ("destination", plan.destinations, destinations, _destination_rank(plan, me)),
    ):
        for name, layout in layouts.items():
            if rank is None or rank not in layout.holders:
                continue
            tensor = tensors.get(name)
            expected = layout.local_shape(rank)
            if tensor is None or tuple(tensor.shape) != expected:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"{side} shard {name}: expected shape {expected}, got {got}")


def _destination_rank(plan: ReshardPlan, me: int) -> int | None:
    rank = me if plan.colocated else me - plan.source_world
    return rank if 0 <= rank < plan.destination_world else None
