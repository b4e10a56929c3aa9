"""Where a tracker keeps its baseline bits: for host compares one flat buffer in memory or in an
mmap'd file; for device compares one tensor per item on the device or in pinned host memory."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from refit_core import GeometryMismatchError
from refit_zmq.tracker.plan import ItemSpan

__all__ = ["BaselineStore", "DeviceBaselines"]

logger = logging.getLogger(__name__)

_SLOT_ALIGN = 64


class BaselineStore:
    """One slot of bits per item, each 64-byte aligned, in one flat buffer made on first use
    (a tracker whose items are all compared on a device never makes it).

    Args:
        items: the items to hold.
        directory: None keeps the bits in memory; a directory holds them in a temporary
            file there, mmap'd, removed by :meth:`close` (for models larger than memory).
    """

    def __init__(self, items: Sequence[ItemSpan], directory: str | os.PathLike[str] | None) -> None:
        self._offsets: dict[tuple[str, int], int] = {}
        total = 0
        for item in items:
            total = -(-total // _SLOT_ALIGN) * _SLOT_ALIGN
            self._offsets[item.name, item.start] = total
            total += item.nbytes
        self._total = total
        self._directory = directory
        self._path: Path | None = None
        self._buffer: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (0 until a slot is first asked for)."""
        return 0 if self._buffer is None else self._total

    def _allocate(self) -> np.ndarray:
        size = max(self._total, 1)
        if self._directory is None:
            return torch.empty(size, dtype=torch.uint8).numpy()
        fd, name = tempfile.mkstemp(prefix="refit-baseline-", dir=self._directory)
        os.close(fd)
        self._path = Path(name)
        logger.info("baseline of %d bytes mmap'd at %s", self._total, self._path)
        return np.memmap(self._path, dtype=np.uint8, mode="w+", shape=(size,))

    def slot(self, item: ItemSpan) -> np.ndarray:
        """The item's bits as a writable uint8 array."""
        if self._buffer is None:
            self._buffer = self._allocate()
        offset = self._offsets[item.name, item.start]
        return self._buffer[offset : offset + item.nbytes]

    def close(self) -> None:
        """Release the buffer and remove the backing file, if any."""
        self._buffer = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


class DeviceBaselines:
    """Baseline bits of the items compared on a device: one flat integer tensor per item.

    Each slot is made on first use, on the device of the tensor it tracks, or with
    ``pinned`` in page-locked host memory (pageable when no accelerator can pin it), from
    which every compare first copies the item's baseline to the device.

    Args:
        pinned: keep the bits in host memory instead of on the device.
    """

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned
        self._slots: dict[tuple[str, int], torch.Tensor] = {}
        self.nbytes = 0

    def slot(self, item: ItemSpan, like: torch.Tensor) -> torch.Tensor:
        """The item's baseline slot for new bits ``like`` (flat, the item's integer dtype).

        Raises:
            GeometryMismatchError: the tensor moved to another device since the slot was made.
        """
        key = (item.name, item.start)
        held = self._slots.get(key)
        if held is None:
            held = self._slots[key] = self._allocate(item, like)
            self.nbytes += item.nbytes
        elif not self.pinned and held.device != like.device:
            raise GeometryMismatchError(
                f"tensor {item.name!r} moved from {held.device} to {like.device}; its "
                "baseline stays where it was made (close the tracker and build a new one)"
            )
        return held

    def _allocate(self, item: ItemSpan, like: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(item.numel, dtype=like.dtype, device=like.device)
        pin = like.device.type == "cuda"
        return torch.empty(item.numel, dtype=like.dtype, pin_memory=pin)

    def close(self) -> None:
        """Release every slot."""
        self._slots.clear()
        self.nbytes = 0
