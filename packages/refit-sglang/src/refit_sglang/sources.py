"""Where the colocated synchronizer's buckets come from: a payload per bucket, alive until
the engines have consumed it.

:class:`LocalBuckets` flattens one in-process policy; :class:`~refit_sglang.ray_gather.
RayTrainerRanks` gathers each bucket from trainer ranks running as Ray actors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass

from refit_core.backend import Deadline, PolicyLike
from refit_sglang.buckets import iter_buckets
from refit_sglang.handles import SharedBuffers

__all__ = ["BucketSource", "LocalBuckets", "Payload"]


@dataclass(frozen=True)
class Payload:
    """One flattened bucket as SGLang's serialized payload strings, and its size.

    Attributes:
        serialized: one payload per receiving rank (each unpickles only its own: every
            serialization is one reference to the buffer).
        nbytes: bytes of the bucket.
        last: whether this is the refit's last bucket.
    """

    serialized: tuple[str, ...]
    nbytes: int
    last: bool


class BucketSource(ABC):
    """Yields each bucket's payload; a bucket's buffer is released when the next one is asked
    for (the engines have consumed it by then), and every buffer when the iteration ends."""

    @abstractmethod
    def payloads(
        self, bucket_size_bytes: int, copies: int, deadline: Deadline
    ) -> Generator[Payload, None, None]:
        """The buckets of the current weights, one at a time, each serialized ``copies``
        times (one per receiving rank); ``close()`` releases them."""

    @abstractmethod
    def close(self) -> None:
        """Release what the source holds."""


class LocalBuckets(BucketSource):
    """Buckets of ``policy`` (in this process) flattened into shared buffers on ``device``."""

    def __init__(self, policy: PolicyLike, device: str = "cpu") -> None:
        self._policy = policy
        self.buffers = SharedBuffers(device)
        """The bucket buffers (``live_bytes`` and ``peak_bytes`` show when they are freed)."""

    def payloads(
        self, bucket_size_bytes: int, copies: int, deadline: Deadline
    ) -> Generator[Payload, None, None]:
        """Flatten, serialize, yield, release: one bucket alive at a time."""
        tensors = ((t.name, t.tensor) for t in self._policy.weight_source().iter_tensors())
        try:
            for bucket, last in iter_buckets(tensors, bucket_size_bytes, self.buffers.allocate):
                try:
                    serialized = tuple(self.buffers.serialize(bucket, copies))
                    yield Payload(serialized, bucket.nbytes, last)
                finally:
                    self.buffers.release(bucket)
        finally:
            self.buffers.release_all()

    def close(self) -> None:
        """Unlink every buffer still held."""
        self.buffers.release_all()
