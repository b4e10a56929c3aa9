"""Host memory for undo copies, recycled from one transfer to the next.

An undo copy of a dense resync is as large as the state, and freshly allocated host memory
is paid for in page faults on first touch (about 0.5 s per GiB measured on this project's
VMs, more than copying the bits). The CUDA caching allocator keeps device memory for reuse;
this does the same for host memory: undo copies are cut from blocks that go back to a free
list when the transfer ends, so the next transfer writes warm pages.
"""

from __future__ import annotations

import numpy as np

__all__ = ["UndoArena"]

_BLOCK_BYTES = 4 << 20


class UndoArena:
    """Blocks of ``block_bytes`` handed out in pieces; at most ``max_pooled_bytes`` kept free.

    Not thread-safe: one receiver thread takes pieces and recycles them.
    """

    def __init__(self, *, max_pooled_bytes: int, block_bytes: int = _BLOCK_BYTES) -> None:
        self._max_pooled = max_pooled_bytes
        self._block_bytes = block_bytes
        self._free: list[np.ndarray] = []
        self._used: list[np.ndarray] = []
        self._block: np.ndarray | None = None
        self._at = 0

    @property
    def pooled_bytes(self) -> int:
        """Bytes kept free for the next transfer."""
        return sum(block.nbytes for block in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """Between 1 and ``nbytes`` (> 0) bytes of uint8 memory, valid until :meth:`recycle`:
        the rest of the current block, or of a new block (a caller copying a long run takes
        piece after piece, and fills every block)."""
        if self._block is None or self._at == self._block.nbytes:
            self._block = self._free.pop() if self._free else np.empty(self._block_bytes, np.uint8)
            self._used.append(self._block)
            self._at = 0
        piece = self._block[self._at : self._at + nbytes]
        self._at += piece.nbytes
        return piece

    def recycle(self) -> None:
        """Every piece handed out is dead (its undo data restored or dropped): reuse the
        blocks, keeping at most ``max_pooled_bytes`` of them."""
        keep = max(0, self._max_pooled // self._block_bytes - len(self._free))
        self._free.extend(self._used[:keep])
        self._used.clear()
        self._block = None
        self._at = 0
