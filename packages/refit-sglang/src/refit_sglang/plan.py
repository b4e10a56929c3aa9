"""The plan of a disaggregated refit: which tensors each ``update_weights_from_distributed``
call names, in broadcast order, and a digest both sides compare before the first byte moves."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from refit_core import TensorSpec
from refit_core.backend import CollectiveSenderSpec
from refit_sglang.buckets import group_by_dtype

__all__ = ["SGLANG_PEER", "DistributedPlan", "StateItems", "sglang_geometry"]

StateItems = tuple[tuple[str, TensorSpec], ...]
"""A state's ``(name, spec)`` pairs in transfer order (as refit-nccl's endpoints take it)."""

SGLANG_PEER = "sglang"
"""``CollectiveSenderSpec.peer`` of SGLang receivers."""


def sglang_geometry(bucket_size_bytes: int) -> CollectiveSenderSpec:
    """What an SGLang receiver declares: tensors broadcast one by one, ``bucket_size_bytes``
    per ``update_weights_from_distributed`` call."""
    return CollectiveSenderSpec(SGLANG_PEER, bucket_size_bytes, 1)


def _nbytes(item: tuple[str, TensorSpec]) -> int:
    spec = item[1]
    return spec.numel * _ITEMSIZE.get(spec.dtype, 8)


_ITEMSIZE = {
    "float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
"""Bytes per element by dtype name (unknown dtypes count as 8, which only shrinks buckets)."""


@dataclass(frozen=True)
class DistributedPlan:
    """Buckets of ``(name, spec)`` in call (and broadcast) order."""

    geometry: CollectiveSenderSpec
    buckets: tuple[StateItems, ...]

    @classmethod
    def build(cls, state: StateItems, geometry: CollectiveSenderSpec) -> DistributedPlan:
        """Group ``state`` by dtype into buckets of ``geometry.buffer_size_bytes``."""
        if geometry.peer != SGLANG_PEER:
            raise ValueError(f"an SGLang plan needs peer {SGLANG_PEER!r}, got {geometry.peer!r}")
        groups = group_by_dtype(
            state, lambda item: item[1].dtype, _nbytes, geometry.buffer_size_bytes
        )
        return cls(geometry, tuple(tuple(group) for group, _ in groups))

    @cached_property
    def dense_bytes(self) -> int:
        """Bytes of every tensor."""
        return sum(_nbytes(item) for bucket in self.buckets for item in bucket)

    @cached_property
    def digest(self) -> str:
        """Hex SHA-256 of the geometry and every bucket's names, dtypes and shapes."""
        canonical = {
            "peer": self.geometry.peer,
            "buffer_size_bytes": self.geometry.buffer_size_bytes,
            "buckets": [[[n, s.dtype, list(s.shape)] for n, s in b] for b in self.buckets],
        }
        return hashlib.sha256(json.dumps(canonical).encode()).hexdigest()
