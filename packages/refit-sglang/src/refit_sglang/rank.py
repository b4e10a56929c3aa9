"""One trainer rank of a colocated refit, as it runs inside its Ray actor.

Every rank serves the tensors it owns for a bucket (:meth:`TrainerRank.refit_pieces`); the
rank colocated with the engine's first rank (the root) gathers the others' pieces and its own
into one flattened buffer the engine maps (:meth:`TrainerRank.refit_gather`), and keeps it
alive until the controller says the engines consumed it (:meth:`TrainerRank.refit_release`).
Each rank reads its weight source once per refit, in its own order, holding only the
tensors a bucket asks for ahead of that order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from refit_core import NamedTensor, ProtocolError, TensorSpec
from refit_core.backend import PolicyLike
from refit_sglang.buckets import FlattenedBucket
from refit_sglang.handles import SharedBuffers

__all__ = ["TrainerRank"]

logger = logging.getLogger(__name__)


class TrainerRank:
    """A trainer rank's side of a colocated refit (wrap it in ``ray.remote``).

    Args:
        policy: this rank's weights (a shard or a full replica); ``weight_source()`` is read
            once per refit.
        device: where the root's bucket buffers live (``cpu``: shared memory; ``cuda``: CUDA
            IPC).
    """

    def __init__(self, policy: PolicyLike, device: str = "cpu") -> None:
        self._policy = policy
        self.buffers = SharedBuffers(device)
        self._stream: Iterator[NamedTensor] | None = None
        self._ahead: dict[str, torch.Tensor] = {}
        self._live: FlattenedBucket | None = None

    def refit_manifest(self) -> dict[str, TensorSpec]:
        """Name -> spec of every tensor this rank holds, in its source's order."""
        return dict(self._policy.weight_source().state_dict_info())

    def refit_begin(self) -> None:
        """Start reading the current weights (a refit begins)."""
        self.refit_end()
        self._stream = iter(self._policy.weight_source().iter_tensors())

    def refit_pieces(self, names: Sequence[str]) -> list[torch.Tensor]:
        """This rank's tensors ``names``, in that order (a non-root rank's part of a bucket)."""
        return [self._take(name) for name in names]

    def refit_gather(
        self,
        names: Sequence[str],
        owners: Sequence[int],
        rank: int,
        copies: int,
        *pieces: list[torch.Tensor],
    ) -> tuple[list[str], int]:
        """Flatten one bucket into a buffer the engine maps; ``(payloads, nbytes)``.

        Args:
            names: the bucket's tensors, in bucket order.
            owners: per name, the rank that holds it.
            rank: this rank's index.
            copies: payloads to make (one per receiving engine rank).
            pieces: per other owner, in order of their first name, its tensors in bucket order.
        """
        others = {owner for owner in owners if owner != rank}
        order = [owner for owner in dict.fromkeys(owners) if owner in others]
        if len(order) != len(pieces):
            raise ProtocolError(f"{len(pieces)} piece lists for {len(order)} other owners")
        streams = {owner: iter(p) for owner, p in zip(order, pieces, strict=True)}
        items = [
            (name, self._take(name) if owner == rank else next(streams[owner]))
            for name, owner in zip(names, owners, strict=True)
        ]
        self.refit_release()
        bucket = self._live = FlattenedBucket.build(items, self.buffers.allocate)
        return self.buffers.serialize(bucket, copies), bucket.nbytes

    def refit_release(self) -> None:
        """Release the bucket buffer the engines have consumed."""
        if self._live is not None:
            self.buffers.release(self._live)
            self._live = None

    def refit_end(self) -> None:
        """Forget the refit: the stream, tensors read ahead, every buffer."""
        self._stream = None
        self._ahead.clear()
        self._live = None
        self.buffers.release_all()

    def refit_memory(self) -> tuple[int, int]:
        """Bucket-buffer bytes alive now and at most (``live_bytes``, ``peak_bytes``)."""
        return self.buffers.live_bytes, self.buffers.peak_bytes

    def _take(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of the current refit, reading the source up to it."""
        if self._stream is None:
            raise ProtocolError("refit_pieces before refit_begin")
        while name not in self._ahead:
            item = next(self._stream, None)
            if item is None:
                raise ProtocolError(f"this rank's source has no tensor {name!r}")
            self._ahead[item.name] = item.tensor
        return self._ahead.pop(name)
