"""Plain value types shared by every backend (no heavy imports)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "MIN_BUFFER_BYTES",
    "CollectiveSenderSpec",
    "NamedTensor",
    "RefitResult",
    "ShardInfo",
    "StateDictInfo",
    "TensorSpec",
    "WeightVersion",
    "WorkerOutcome",
    "checked_buffer_size",
    "dtype_name",
]

MIN_BUFFER_BYTES = 1024 * 1024
"""The smallest packed bucket a collective receiver takes (1 MiB)."""


def dtype_name(dtype: object) -> str:
    """Name of a torch dtype without the ``torch.`` prefix (``torch.bfloat16`` -> ``bfloat16``)."""
    text = str(dtype)
    return text.removeprefix("torch.")


@dataclass(frozen=True)
class ShardInfo:
    """Where a tensor shard sits in its full tensor: slice ``index`` of ``count`` along ``dim``."""

    dim: int
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count or self.dim < 0:
            raise ValueError(f"invalid shard {self}")


@dataclass(frozen=True)
class NamedTensor:
    """One tensor on its way to an engine, under the engine's checkpoint name.

    ``metadata`` carries what must travel with the tensor (for example FP8 block scales).
    """

    name: str
    tensor: torch.Tensor
    shard: ShardInfo | None = None
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype (name without ``torch.``) of one tensor of a state dict."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        if not self.dtype or self.dtype.startswith("torch."):
            raise ValueError(f"dtype must be a bare torch dtype name, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        """Spec of an existing tensor."""
        return cls(tuple(tensor.shape), dtype_name(tensor.dtype))


StateDictInfo = Mapping[str, TensorSpec]
"""Name -> spec of every tensor a refit carries (``state_dict_info`` in the seeds)."""


@dataclass(frozen=True, order=True)
class WeightVersion:
    """A monotonically increasing weight version; 0 is the engine's initial load."""

    value: int = 0

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError(f"weight version must be >= 0, got {self.value}")

    def next(self) -> WeightVersion:
        """The version that follows this one."""
        return WeightVersion(self.value + 1)

    def require_advance_to(self, new: WeightVersion) -> None:
        """Raise ValueError unless ``new`` is strictly greater than this version."""
        if new <= self:
            raise ValueError(f"weight version must increase: {self.value} -> {new.value}")


def checked_buffer_size(buffer_size_bytes: int, what: str = "buffer_size_bytes") -> int:
    """``buffer_size_bytes`` if a collective receiver takes it as its bucket size.

    Raises:
        TypeError: not an int.
        ValueError: below :data:`MIN_BUFFER_BYTES`.
    """
    if isinstance(buffer_size_bytes, bool) or not isinstance(buffer_size_bytes, int):
        raise TypeError(f"{what} must be an int, got {buffer_size_bytes!r}")
    if buffer_size_bytes < MIN_BUFFER_BYTES:
        raise ValueError(f"{what} must be >= {MIN_BUFFER_BYTES} (1 MiB), got {buffer_size_bytes}")
    return buffer_size_bytes


@dataclass(frozen=True)
class CollectiveSenderSpec:
    """Packing geometry declared by a collective receiver.

    Attributes:
        peer: the protocol the receiver speaks (``"refit"``, ``"vllm"``, ``"sglang"``).
        buffer_size_bytes: size of one packed bucket.
        num_buffers: how many buckets may be in flight (pipelining depth).
    """

    peer: str
    buffer_size_bytes: int
    num_buffers: int

    def __post_init__(self) -> None:
        if not self.peer:
            raise ValueError("peer must be named")
        checked_buffer_size(self.buffer_size_bytes)
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {self.num_buffers}")


@dataclass(frozen=True)
class WorkerOutcome:
    """How one engine worker ended a refit.

    In a refit that returned (rather than raised), ``ok`` False means the engine was told to
    switch but has not confirmed it yet: see :attr:`RefitResult.engines_to_switch`.
    """

    worker: str
    ok: bool
    version: int | None
    error: str | None = None


@dataclass(frozen=True)
class RefitResult:
    """What one refit did.

    Attributes:
        version: the weight version every successful worker now serves.
        timings_s: seconds per phase (for example ``{"pack": .., "transfer": .., "verify": ..}``).
        total_s: wall time of the whole refit.
        wire_bytes: bytes put on the wire (after any compression).
        dense_bytes: bytes of the full state the refit represents.
        changed_elements: elements that changed, where the transport knows it.
        workers: per-worker outcome.
    """

    version: int
    timings_s: Mapping[str, float]
    total_s: float
    wire_bytes: int
    dense_bytes: int
    workers: tuple[WorkerOutcome, ...] = ()
    changed_elements: int | None = None

    @property
    def ok(self) -> bool:
        """True when every worker succeeded."""
        return all(w.ok for w in self.workers)

    @property
    def engines_to_switch(self) -> tuple[str, ...]:
        """Engines the refit committed on but that did not confirm they serve ``version`` yet
        (a relay frozen after it prepared: it commits by itself once it runs again). Empty
        when every engine serves it; ``WeightSynchronizer.wait_for_switch`` waits for them."""
        return tuple(w.worker for w in self.workers if not w.ok)

    @property
    def effective_gbps(self) -> float:
        """Dense bytes delivered per second of refit (GB/s, 1e9)."""
        return self.dense_bytes / self.total_s / 1e9 if self.total_s > 0 else math.inf
