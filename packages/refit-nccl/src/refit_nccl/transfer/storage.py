"""Where bucket bytes live: reusable staging buffers, or storage laid out by the plan itself."""

from __future__ import annotations

import torch

from refit_nccl.transfer.packing import slot_view
from refit_nccl.transfer.plan import TransferPlan

__all__ = ["PlanStorage", "StagingBuffers"]


class StagingBuffers:
    """Packing buffers reused across transfers (fresh pages would cost a fault per page)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def get(self, count: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """``count`` uint8 buffers of at least ``nbytes`` on ``device``."""
        fits = [b for b in self._buffers if b.device == device and b.numel() >= nbytes]
        if len(fits) < count:
            fits += [
                torch.empty(nbytes, dtype=torch.uint8, device=device)
                for _ in range(count - len(fits))
            ]
            self._buffers = fits
        return fits[:count]


class PlanStorage:
    """A receiver's tensors laid out exactly as a plan's buckets, one allocation per bucket.

    A receiver that keeps its weights here (``tensors()`` are views of it) receives every
    bucket straight into place: no staging buffer and no copy after the wire.
    """

    def __init__(self, plan: TransferPlan, device: torch.device) -> None:
        self.plan = plan
        self._buckets = [
            torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device) for bucket in plan.buckets
        ]

    def bucket(self, index: int) -> torch.Tensor:
        """The bytes of bucket ``index``."""
        return self._buckets[index]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> the tensor, a view of its bucket's bytes, in plan order."""
        return {
            slot.name: slot_view(data, slot)
            for bucket, data in zip(self.plan.buckets, self._buckets, strict=True)
            for slot in bucket.slots
        }
