"""Flattened tensor buckets: one contiguous buffer per dtype, rebuilt as zero-copy views.

The metadata objects carry the attribute names of SGLang's ``FlattenedTensorMetadata``
(``sglang.srt.weight_sync.tensor_bucket``: name, shape, dtype, start_idx, end_idx, numel), so
an SGLang receiver rebuilds a bucket refit sent with ``load_format="flattened_bucket"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["Allocator", "FlattenedBucket", "TensorSlot", "group_by_dtype", "iter_buckets"]

_T = TypeVar("_T")

Allocator = Callable[[torch.dtype, int], torch.Tensor]
"""Returns a 1-D tensor of ``numel`` elements of ``dtype`` to flatten a bucket into."""


def _empty(dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in its bucket: elements ``[start_idx, end_idx)``."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass(frozen=True)
class FlattenedBucket:
    """Tensors of one dtype flattened into ``flattened_tensor``, described by ``metadata``."""

    flattened_tensor: torch.Tensor
    metadata: tuple[TensorSlot, ...]

    @classmethod
    def build(
        cls, named: Iterable[tuple[str, torch.Tensor]], allocate: Allocator = _empty
    ) -> FlattenedBucket:
        """Copy ``named`` (one dtype, at least one tensor) into a buffer from ``allocate``."""
        items = list(named)
        if not items:
            raise ValueError("a bucket needs at least one tensor")
        dtypes = {t.dtype for _, t in items}
        if len(dtypes) != 1:
            raise ValueError(f"a bucket holds one dtype, got {sorted(map(str, dtypes))}")
        slots: list[TensorSlot] = []
        start = 0
        for name, tensor in items:
            numel = tensor.numel()
            slots.append(TensorSlot(name, tensor.shape, tensor.dtype, start, start + numel, numel))
            start += numel
        buffer = allocate(items[0][1].dtype, start)
        for slot, (_, tensor) in zip(slots, items, strict=True):
            buffer[slot.start_idx : slot.end_idx].copy_(tensor.reshape(-1))
        return cls(buffer, tuple(slots))

    @property
    def nbytes(self) -> int:
        """Bytes of the flattened buffer."""
        return self.flattened_tensor.numel() * self.flattened_tensor.element_size()

    def views(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` per slot: views into the buffer, no copy."""
        flat = self.flattened_tensor
        return [(s.name, flat[s.start_idx : s.end_idx].view(s.shape)) for s in self.metadata]


def group_by_dtype(
    items: Iterable[_T],
    dtype_of: Callable[[_T], object],
    nbytes_of: Callable[[_T], int],
    limit: int,
) -> Iterator[tuple[list[_T], bool]]:
    """Group ``items`` by dtype into groups of at most ``limit`` bytes, in completion order.

    Yields ``(group, last)``; ``last`` is true for the final group only (a group closed while
    items still arrive is never the last: the item that closed it is still pending). A
    single item larger than ``limit`` forms a group of its own. Both sides of a transfer
    derive the same groups from the same items.
    """
    if limit <= 0:
        raise ValueError(f"the bucket size must be positive, got {limit}")
    pending: dict[object, list[_T]] = {}
    sizes: dict[object, int] = {}
    for item in items:
        dtype, size = dtype_of(item), nbytes_of(item)
        group = pending.setdefault(dtype, [])
        if group and sizes[dtype] + size > limit:
            yield list(group), False
            group.clear()
            sizes[dtype] = 0
        group.append(item)
        sizes[dtype] = sizes.get(dtype, 0) + size
    rest = [group for group in pending.values() if group]
    for index, group in enumerate(rest):
        yield group, index == len(rest) - 1


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_size_bytes: int,
    allocate: Allocator = _empty,
) -> Iterator[tuple[FlattenedBucket, bool]]:
    """Flattened buckets of ``named``, grouped by :func:`group_by_dtype`; ``(bucket, last)``.

    At most one unfinished bucket per dtype is held (as references to the source tensors);
    each bucket is flattened into ``allocate``'s buffer when it is yielded.
    """
    for group, last in group_by_dtype(
        named, lambda item: item[1].dtype, lambda item: _nbytes(item[1]), bucket_size_bytes
    ):
        yield FlattenedBucket.build(group, allocate), last


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()
