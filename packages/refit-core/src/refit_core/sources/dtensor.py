"""The FSDP2 / DTensor source: sharded trainer state, gathered one bucket at a time.

Every rank of the trainer's meshes iterates the source in lock step. For each bucket, in the
same order on every rank, each input is cast once on its local shard (elementwise, so the
bits equal a cast of the whole tensor) and gathered with ``DTensor.full_tensor()``, which
waits on its collectives before it returns (so they are issued, in order, before anything the
consumer does next); plain tensors are whole already and are only
cast. Sending ranks keep the gathered tensors and yield them; every other rank drops each one
as soon as its gather returns.

Memory bound, with U the largest unit and B = max(bucket_size_bytes, U), both in the
engine's dtype, on W >= 2 ranks: one gather's transient is at most (2 + 2/W) U <= 3U (the
cast shard, DTensor's padded shard and padded all-gather for an uneven shard, the unpadded
copy), so a sending rank holds at most B + 3U extra and any other rank 3U, whatever the
model's size (a fuse's concatenation fits within it). The gathers' deadline is the
process-group timeout the trainer set (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from refit_core.errors import GeometryMismatchError
from refit_core.sources.cast import cast_once
from refit_core.sources.name_map import NameMap, Rename, as_name_map
from refit_core.sources.ordering import CollectiveOrderGuard
from refit_core.sources.plan import (
    Unit,
    fingerprint,
    materialize,
    pack_buckets,
    plan_info,
    state_plan,
    state_tensors,
)
from refit_core.sources.protocol import Bucket
from refit_core.types import NamedTensor, StateDictInfo

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["DTensorSource"]

logger = logging.getLogger(__name__)


class DTensorSource:
    """FSDP2 / DTensor trainer state as a bounded-memory stream of checkpoint tensors.

    Satisfies :class:`~refit_core.sources.protocol.ShardedWeightSource`. Before the first
    bucket the ranks of every mesh compare a fingerprint of the bucket plan and all raise
    :class:`~refit_core.errors.GeometryMismatchError` if any differs, rather than gather out
    of step.

    Args:
        state: a module (``fully_shard``-ed or not; its ``state_dict()`` is read on every
            call) or a name -> tensor mapping of DTensors and plain tensors.
        dtype: the engine's dtype name; wide floating tensors are cast to it once, before the
            gather. None keeps each tensor's dtype.
        name_map: trainer name -> checkpoint name: a :class:`NameMap` or a rename callable.
        bucket_size_bytes: bytes (engine dtype) gathered before a bucket is yielded; a unit
            larger than this travels alone. None gathers one unit (one tensor, or one fuse
            group with the scales riding on it) per bucket.
        sender_ranks: global ranks that keep and yield the gathered tensors.
        order_guard: guard shared with the consumer's collectives; a new one by default.
    """

    def __init__(
        self,
        state: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        dtype: str | None = None,
        name_map: NameMap | Rename | None = None,
        bucket_size_bytes: int | None = None,
        sender_ranks: Collection[int] = (0,),
        order_guard: CollectiveOrderGuard | None = None,
    ) -> None:
        if bucket_size_bytes is not None and bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be > 0 or None, got {bucket_size_bytes}")
        self._state = state
        self._dtype = dtype
        self._name_map = as_name_map(name_map)
        self._bucket_size_bytes = bucket_size_bytes
        self._sender_ranks = frozenset(sender_ranks)
        self._guard = order_guard if order_guard is not None else CollectiveOrderGuard()

    @property
    def order_guard(self) -> CollectiveOrderGuard:
        """The guard this source's gathers and its consumer's collectives share."""
        return self._guard

    @property
    def sends(self) -> bool:
        """Whether this rank keeps and yields the gathered tensors."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return rank in self._sender_ranks

    def state_dict_info(self) -> StateDictInfo:
        """Checkpoint name -> spec of every tensor (global shapes; no collective)."""
        return plan_info(state_plan(state_tensors(self._state), self._name_map, self._dtype))

    def iter_buckets(self) -> Iterator[Bucket]:
        """Yield every bucket, each gathered in full before it is yielded, on every rank."""
        tensors = state_tensors(self._state)
        units = state_plan(tensors, self._name_map, self._dtype)
        buckets = pack_buckets(units, self._bucket_size_bytes)
        keep = self.sends
        with self._guard.gather():
            _check_same_plan(tensors, buckets)
        for index, bucket in enumerate(buckets):
            with self._guard.gather():
                gathered = [t for unit in bucket for t in _gather_unit(unit, tensors, keep)]
            logger.debug("bucket %d: %d units gathered, kept=%s", index, len(bucket), keep)
            yield Bucket(index, plan_info(bucket), tuple(gathered))

    def iter_tensors(self) -> Iterator[NamedTensor]:
        """Every bucket's tensors, in order (nothing on a rank that does not send)."""
        for bucket in self.iter_buckets():
            yield from bucket.tensors


def _dtensor_type() -> type[DTensor] | None:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not loaded (then no
    tensor can be a DTensor, and a state of plain tensors skips that heavy import)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor: type[DTensor] | None = getattr(module, "DTensor", None)
    return dtensor


def _gather_unit(unit: Unit, tensors: Mapping[str, torch.Tensor], keep: bool) -> list[NamedTensor]:
    """Cast and gather each input of ``unit``; materialize it only where it is kept."""
    dtensor = _dtensor_type()
    whole: list[torch.Tensor] = []
    for name, dtype in unit.inputs:
        local = cast_once(tensors[name], dtype)
        full = local.full_tensor() if dtensor and isinstance(local, dtensor) else local
        del local
        if keep:
            whole.append(full)
        del full  # a rank that does not send drops the gathered tensor here
    return materialize(unit, whole) if keep else []


def _check_same_plan(
    tensors: Mapping[str, torch.Tensor], buckets: Sequence[tuple[Unit, ...]]
) -> None:
    """Raise GeometryMismatchError on every rank unless all ranks of every mesh planned alike."""
    import torch
    import torch.distributed as dist

    dtensor = _dtensor_type()
    if dtensor is None:
        return
    planned = fingerprint(buckets)
    meshes: dict[DeviceMesh, None] = {
        t.device_mesh: None for t in tensors.values() if isinstance(t, dtensor)
    }
    for mesh in meshes:
        for group in mesh.get_all_groups():
            mine = torch.tensor([planned], dtype=torch.int64, device=mesh.device_type)
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, mine, group=group)
            seen = sorted({int(t.item()) for t in everyone})
            if seen != [planned]:
                raise GeometryMismatchError(
                    f"ranks planned different buckets (fingerprints {seen}); every rank must "
                    "hold the same state names, shapes and dtypes"
                )
