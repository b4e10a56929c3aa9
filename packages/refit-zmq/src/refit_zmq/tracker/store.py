"""Where a tracker keeps its baseline bits: one flat buffer in memory or in an mmap'd file."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from refit_zmq.tracker.plan import ItemSpan

__all__ = ["BaselineStore"]

logger = logging.getLogger(__name__)

_SLOT_ALIGN = 64


class BaselineStore:
    """One slot of bits per item, each 64-byte aligned, in one flat buffer.

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
        self._path: Path | None = None
        self._buffer: np.ndarray
        if directory is None:
            self._buffer = torch.empty(max(total, 1), dtype=torch.uint8).numpy()
        else:
            fd, name = tempfile.mkstemp(prefix="refit-baseline-", dir=directory)
            os.close(fd)
            self._path = Path(name)
            self._buffer = np.memmap(self._path, dtype=np.uint8, mode="w+", shape=(max(total, 1),))
            logger.info("baseline of %d bytes mmap'd at %s", total, self._path)
        self.nbytes = total

    def slot(self, item: ItemSpan) -> np.ndarray:
        """The item's bits as a writable uint8 array."""
        offset = self._offsets[item.name, item.start]
        return self._buffer[offset : offset + item.nbytes]

    def close(self) -> None:
        """Release the buffer and remove the backing file, if any."""
        self._buffer = np.empty(0, dtype=np.uint8)
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
