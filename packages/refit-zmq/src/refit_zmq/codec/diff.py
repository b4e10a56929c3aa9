"""The change-detection kernel: which elements of a baseline range differ from the new bits.

A range is scanned in cache-sized chunks, each compared as 64-bit words (four bf16 or two
fp32 elements per compare), which makes the compare and the nonzero scan four or two times
shorter than per element; only the few changed words are then split into elements. The kernel
only reads; everything is numpy on unsigned views, which releases the GIL, so ranges run in
parallel on a thread pool.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from refit_zmq.codec.dtypes import unsigned_numpy_dtype

__all__ = ["diff_range"]

_local = threading.local()


def _mask(size: int) -> np.ndarray:
    """A per-thread scratch bool buffer (allocated once, so no page faults per chunk)."""
    mask: np.ndarray | None = getattr(_local, "mask", None)
    if mask is None or mask.size < size:
        mask = _local.mask = np.empty(size, dtype=np.bool_)
    return mask[:size]


def _diff_chunk(
    base: np.ndarray,
    new: np.ndarray,
    mask: np.ndarray,
    element: np.dtype[Any],
    per: int,
    start: int,
) -> tuple[np.ndarray, np.ndarray]:
    np.not_equal(base, new, out=mask)
    words = mask.nonzero()[0]
    if per == 1:
        values = new[words]
        words += start
        return words, values
    new_elems = new[words].view(element)
    lanes = np.not_equal(base[words].view(element), new_elems).nonzero()[0]
    shift = per.bit_length() - 1
    indices = words[lanes >> shift]
    indices += start
    indices <<= shift
    indices |= lanes & (per - 1)
    return indices, new_elems[lanes]


def diff_range(
    base: np.ndarray, new: np.ndarray, *, per: int, start: int, chunk_words: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Indices and new bits of the elements where ``new`` differs from ``base``, per chunk.

    Args:
        base: baseline words (unsigned; read only).
        new: new words, same dtype and size.
        per: elements per word, a power of two (1 when the words are the elements).
        start: index of ``base[0]`` among its unit's words (indices are unit-relative).
        chunk_words: words compared per step (cache-sized).

    Returns:
        Per chunk, in order: int64 element indices (ascending) and the new bits there.
    """
    element = unsigned_numpy_dtype(base.itemsize // per)
    mask = _mask(min(chunk_words, base.size))
    return [
        _diff_chunk(
            base[a : a + chunk_words],
            new[a : a + chunk_words],
            mask[: min(chunk_words, base.size - a)],
            element,
            per,
            start + a,
        )
        for a in range(0, base.size, chunk_words)
    ]
