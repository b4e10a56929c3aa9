"""Deterministic split of a state dict into items and of items among producer shards.

Every producer computes the same plan from the same inputs (the state dict's specs, the shard
count and the largest item size), so producers agree on who sends what without talking:
together they send every element exactly once.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from refit_core import StateDictInfo, TensorSpec
from refit_zmq.codec.dtypes import dtype_code

__all__ = ["ALIGN_ELEMENTS", "ItemSpan", "plan_items", "shard_items"]

ALIGN_ELEMENTS = 64
"""Item boundaries inside a tensor fall on multiples of this many elements (8-byte aligned)."""


@dataclass(frozen=True)
class ItemSpan:
    """Elements ``[start, stop)`` (row-major) of tensor ``name``: one item of a payload."""

    name: str
    spec: TensorSpec
    start: int
    stop: int

    @property
    def dtype(self) -> torch.dtype:
        """The tensor's torch dtype."""
        dtype: torch.dtype = getattr(torch, self.spec.dtype)
        return dtype

    @property
    def numel(self) -> int:
        """Elements in the span."""
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        """Dense bytes of the span."""
        return self.numel * self.dtype.itemsize


def _split(name: str, spec: TensorSpec, max_item_bytes: int) -> Iterable[ItemSpan]:
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {name!r}: unknown dtype {spec.dtype}")
    dtype_code(dtype)
    step = max(ALIGN_ELEMENTS, max_item_bytes // dtype.itemsize // ALIGN_ELEMENTS * ALIGN_ELEMENTS)
    numel = spec.numel
    if numel == 0:
        yield ItemSpan(name, spec, 0, 0)
    for start in range(0, numel, step):
        yield ItemSpan(name, spec, start, min(numel, start + step))


def plan_items(spec: StateDictInfo, *, max_item_bytes: int) -> list[ItemSpan]:
    """Every item of the state dict, tensors in ``spec`` order, each cut into spans."""
    if max_item_bytes < 1:
        raise ValueError(f"max_item_bytes must be >= 1, got {max_item_bytes}")
    return [item for name, tensor in spec.items() for item in _split(name, tensor, max_item_bytes)]


def shard_items(
    spec: StateDictInfo, *, shard_rank: int, shard_count: int, max_item_bytes: int
) -> list[ItemSpan]:
    """The items producer ``shard_rank`` of ``shard_count`` owns, in ``spec`` order.

    Items go largest first (ties by name and start, so dict order does not matter) to the
    least-loaded shard (ties to the lowest rank): a balanced, deterministic partition.
    """
    if shard_count < 1 or not 0 <= shard_rank < shard_count:
        raise ValueError(f"invalid shard {shard_rank} of {shard_count}")
    items = plan_items(spec, max_item_bytes=max_item_bytes)
    loads = [(0, rank) for rank in range(shard_count)]
    owner: dict[tuple[str, int], int] = {}
    for item in sorted(items, key=lambda i: (-i.nbytes, i.name, i.start)):
        load, rank = heapq.heappop(loads)
        owner[item.name, item.start] = rank
        heapq.heappush(loads, (load + item.nbytes, rank))
    return [item for item in items if owner[item.name, item.start] == shard_rank]
