"""The ceiling of any CPU change detection here: the baseline and the new bits read once.

Whatever a delta encoder does, it reads every byte of both versions. :class:`ReadBoth` does
that and next to nothing else: each thread takes an equal, contiguous share of the bytes and
XORs them block by block into scratch that stays in its cache, testing each block for a
difference. What it reaches, measured in the same rounds as the encoder, bounds the encoder's
rate on this machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["ReadBoth"]

BLOCK_BYTES = 256 * 1024
"""XORed at a time: both blocks and the scratch stay in a core's cache."""

Pair = tuple[np.ndarray, np.ndarray]


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class ReadBoth:
    """Reads two states of the same names and shapes once per :meth:`seconds` on ``threads``
    threads. Use as a context manager (it owns its threads)."""

    def __init__(
        self, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, threads: int
    ) -> None:
        pairs = [
            (a[at : at + BLOCK_BYTES], b[at : at + BLOCK_BYTES])
            for a, b in ((_bytes(old[name]), _bytes(new[name])) for name in old)
            for at in range(0, a.size, BLOCK_BYTES)
        ]
        total = sum(a.size for a, _ in pairs)
        self._shares: list[list[Pair]] = [[] for _ in range(threads)]
        done = 0
        for pair in pairs:
            self._shares[min(threads - 1, done * threads // max(1, total))].append(pair)
            done += pair[0].size
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="read-both")
        self.differ = False
        """Whether the last pass found any block that differs."""

    def _read(self, share: Sequence[Pair]) -> bool:
        scratch: np.ndarray | None = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = np.empty(BLOCK_BYTES, dtype=np.uint8)
        differ = False
        for a, b in share:
            out = scratch[: a.size]
            np.bitwise_xor(a, b, out=out)
            differ = bool(out.any()) or differ
        return differ

    def seconds(self) -> float:
        """Time one pass over both states."""
        started = time.perf_counter()
        self.differ = any(list(self._pool.map(self._read, self._shares)))
        return time.perf_counter() - started

    def __enter__(self) -> ReadBoth:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()
