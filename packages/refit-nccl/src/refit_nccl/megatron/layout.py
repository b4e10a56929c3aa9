"""Where each rank's shard of a parameter sits in the parameter's global (checkpoint) tensor.

A :class:`ParamLayout` names, for every rank that holds part of a parameter, the ordered
:class:`Span` s of the global tensor along one dimension that the rank's local tensor is made
of (concatenated along that dimension, in order; every other dimension is whole). A plain
tensor-parallel shard is one span; Megatron's fused ``gate_up`` shard is two (its slice of
``gate``, then its slice of ``up``); a replicated parameter gives several ranks the same span;
a pipeline stage or an expert-parallel rank that does not own the parameter is absent.
Pure data: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ParamLayout", "Span"]


@dataclass(frozen=True, order=True)
class Span:
    """Indices ``[start, stop)`` of the global tensor along a layout's dimension."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"bad span [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is split over ranks.

    Attributes:
        shape: the global (unsharded) shape.
        itemsize: bytes per element.
        dim: the dimension the spans index.
        holders: rank -> the spans its local tensor concatenates along ``dim``.
    """

    shape: tuple[int, ...]
    itemsize: int
    dim: int
    holders: Mapping[int, tuple[Span, ...]]

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.shape):
            raise ValueError(f"dim {self.dim} is not a dimension of {self.shape}")
        size = self.shape[self.dim]
        for rank, spans in self.holders.items():
            if rank < 0 or any(s.stop > size for s in spans):
                raise ValueError(f"rank {rank}: spans {spans} do not fit dim of size {size}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along :attr:`dim` (the product of the other dimensions)."""
        return math.prod(self.shape) // max(self.shape[self.dim], 1) * self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor."""
        return math.prod(self.shape) * self.itemsize

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor."""
        rows = sum(len(s) for s in self.holders[rank])
        return (*self.shape[: self.dim], rows, *self.shape[self.dim + 1 :])

    def local_offset(self, rank: int, index: int) -> int:
        """Position along :attr:`dim` of global ``index`` in ``rank``'s local tensor."""
        offset = 0
        for span in self.holders[rank]:
            if span.start <= index < span.stop:
                return offset + index - span.start
            offset += len(span)
        raise ValueError(f"rank {rank} does not hold index {index}")
