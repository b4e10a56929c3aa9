"""The transfer plan: which tensor goes into which packed bucket at which byte offset.

Both sides of a transfer build the plan from the same inputs (the state's names, dtypes and
shapes in transfer order, and the receiver's declared :class:`CollectiveSenderSpec`) and
compare :meth:`TransferPlan.digest` before the first byte moves, so packing geometry can never
silently diverge. The packing rule follows the receiver's protocol (``geometry.peer``):

* ``"refit"``: every tensor starts at a multiple of :data:`ALIGN_BYTES`, a bucket never
  exceeds ``buffer_size_bytes``, and a tensor larger than that travels alone in its own
  storage (a *solo* bucket: no packing copy on either side).
* ``"vllm"``: vLLM's packed consumer: tensors back to back, a bucket closes once its size
  exceeds ``buffer_size_bytes``. A plan whose offsets would misalign a dtype is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from refit_core import GeometryMismatchError, StateDictInfo, TensorSpec
from refit_core.backend import CollectiveSenderSpec

__all__ = ["ALIGN_BYTES", "PACKING_RULES", "PackedBucket", "Slot", "TransferPlan", "torch_dtype"]

ALIGN_BYTES = 16
"""Alignment of every tensor inside a ``refit`` bucket (valid for every dtype view)."""

_PLAN_FORMAT = "refit-plan/1"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket: ``nbytes`` bytes starting at ``offset``."""

    name: str
    spec: TensorSpec
    offset: int
    nbytes: int

    @cached_property
    def dtype(self) -> torch.dtype:
        """The tensor's torch dtype."""
        return torch_dtype(self.spec.dtype)


@dataclass(frozen=True)
class PackedBucket:
    """One bucket of a transfer plan: tensors broadcast together as ``nbytes`` bytes; a solo
    bucket holds one large tensor (a source's own buckets are ``refit_core.sources.Bucket``)."""

    slots: tuple[Slot, ...]
    nbytes: int
    solo: bool = False


def _nbytes(spec: TensorSpec) -> int:
    return spec.numel * torch_dtype(spec.dtype).itemsize


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def _bucket(slots: list[Slot]) -> PackedBucket:
    return PackedBucket(tuple(slots), slots[-1].offset + slots[-1].nbytes)


def _refit_rule(items: Iterable[tuple[str, TensorSpec]], limit: int) -> list[PackedBucket]:
    buckets: list[PackedBucket] = []
    slots: list[Slot] = []
    for name, spec in items:
        size = _nbytes(spec)
        if size > limit:
            if slots:
                buckets.append(_bucket(slots))
                slots = []
            buckets.append(PackedBucket((Slot(name, spec, 0, size),), size, solo=True))
            continue
        start = _align(slots[-1].offset + slots[-1].nbytes) if slots else 0
        if slots and start + size > limit:
            buckets.append(_bucket(slots))
            slots, start = [], 0
        slots.append(Slot(name, spec, start, size))
    if slots:
        buckets.append(_bucket(slots))
    return buckets


def _vllm_rule(items: Iterable[tuple[str, TensorSpec]], limit: int) -> list[PackedBucket]:
    buckets: list[PackedBucket] = []
    slots: list[Slot] = []
    offset = 0
    for name, spec in items:
        itemsize = torch_dtype(spec.dtype).itemsize
        if offset % itemsize:
            raise GeometryMismatchError(
                f"vLLM's packing would place {name!r} ({spec.dtype}) at byte {offset} of its "
                "bucket, which is not a valid view for that dtype; reorder the state or use "
                "the refit peer"
            )
        size = _nbytes(spec)
        slots.append(Slot(name, spec, offset, size))
        offset += size
        if offset > limit:
            buckets.append(PackedBucket(tuple(slots), offset))
            slots, offset = [], 0
    if slots:
        buckets.append(PackedBucket(tuple(slots), offset))
    return buckets


PACKING_RULES: dict[str, Callable[[Iterable[tuple[str, TensorSpec]], int], list[PackedBucket]]] = {
    "refit": _refit_rule,
    "vllm": _vllm_rule,
}
"""Packing rule per receiver protocol (``CollectiveSenderSpec.peer``)."""


@dataclass(frozen=True)
class TransferPlan:
    """Buckets of one transfer, in broadcast order; build it with :meth:`build`."""

    geometry: CollectiveSenderSpec
    buckets: tuple[PackedBucket, ...]

    @classmethod
    def build(cls, info: StateDictInfo, geometry: CollectiveSenderSpec) -> TransferPlan:
        """Plan ``info`` (name -> spec, in transfer order) for a receiver's ``geometry``.

        Raises:
            ValueError: an unknown dtype, or a peer without a packing rule.
            GeometryMismatchError: the peer's rule cannot place a tensor validly.
        """
        rule = PACKING_RULES.get(geometry.peer)
        if rule is None:
            raise ValueError(
                f"no packing rule for peer {geometry.peer!r}; known: {', '.join(PACKING_RULES)}"
            )
        return cls(geometry, tuple(rule(info.items(), geometry.buffer_size_bytes)))

    @cached_property
    def num_tensors(self) -> int:
        """Number of tensors the plan carries."""
        return sum(len(b.slots) for b in self.buckets)

    @cached_property
    def wire_bytes(self) -> int:
        """Bytes broadcast, alignment padding included."""
        return sum(b.nbytes for b in self.buckets)

    @cached_property
    def dense_bytes(self) -> int:
        """Bytes of the tensors themselves."""
        return sum(s.nbytes for b in self.buckets for s in b.slots)

    @cached_property
    def buffer_bytes(self) -> int:
        """Size of one packing buffer: the largest packed (non-solo) bucket, or 0."""
        return max((b.nbytes for b in self.buckets if not b.solo), default=0)

    @cached_property
    def digest(self) -> str:
        """Hex SHA-256 of the geometry, the rule's output and every name, dtype and shape."""
        canonical = {
            "format": _PLAN_FORMAT,
            "peer": self.geometry.peer,
            "buffer_size_bytes": self.geometry.buffer_size_bytes,
            "num_buffers": self.geometry.num_buffers,
            "buckets": [
                [
                    b.solo,
                    b.nbytes,
                    [[s.name, s.spec.dtype, list(s.spec.shape), s.offset] for s in b.slots],
                ]
                for b in self.buckets
            ],
        }
        encoded = json.dumps(canonical, separators=(",", ":"), ensure_ascii=True).encode()
        return hashlib.sha256(encoded).hexdigest()
