"""The change-detection kernel: which elements of a baseline range differ from the new bits.

One compiled pass (numba, no GIL) reads both ranges once as words (64-bit where aligned, so
four bf16 or two fp32 elements per compare), tests a cache line at a time with the OR of its
word XORs, and only inside a dirty line compares elements, appending each changed element's
index and new bits. Measured on the bench's full state at 1% changed, two threads, against
torch's memcpy of the same bytes in the same run: numpy's bare word compare 1.0x, this kernel
0.57-0.66x, the numpy pipeline it replaces (compare into a mask, ``nonzero``, gather, refine
lanes) 0.45-0.53x; two-level ``nonzero`` and other chunk sizes were no faster. Branch-free
appends and 4- or 16-word lines measured slower than the branches on 8-word lines.

A range is processed in chunks so the outputs go to per-thread scratch of bounded size; the
kernel only reads the inputs.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

__all__ = ["diff_range"]

_LINE_WORDS = 8
"""Words tested together: one 64-byte cache line of 64-bit words."""

_local = threading.local()


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _refine(
    base: np.ndarray,
    new: np.ndarray,
    base_el: np.ndarray,
    new_el: np.ndarray,
    per: int,
    lo: int,
    hi: int,
    indices: np.ndarray,
    values: np.ndarray,
    count: int,
) -> int:  # pragma: no cover - compiled
    """Append the changed elements of words ``[lo, hi)``; return the new count."""
    for i in range(lo, hi):
        if base[i] != new[i]:
            for j in range(i * per, (i + 1) * per):
                if base_el[j] != new_el[j]:
                    indices[count] = j
                    values[count] = new_el[j]
                    count += 1
    return count


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _collect(
    base: np.ndarray,
    new: np.ndarray,
    base_el: np.ndarray,
    new_el: np.ndarray,
    per: int,
    indices: np.ndarray,
    values: np.ndarray,
) -> int:  # pragma: no cover - compiled; exercised through diff_range
    count = 0
    lines = base.size // _LINE_WORDS
    for line in range(lines):
        at = line * _LINE_WORDS
        dirty = base[at] ^ new[at]
        for i in range(at + 1, at + _LINE_WORDS):
            dirty |= base[i] ^ new[i]
        if dirty:
            end = at + _LINE_WORDS
            count = _refine(base, new, base_el, new_el, per, at, end, indices, values, count)
    at = lines * _LINE_WORDS
    return _refine(base, new, base_el, new_el, per, at, base.size, indices, values, count)


def _scratch(elements: int, element: np.dtype[np.unsignedinteger]) -> tuple[np.ndarray, np.ndarray]:
    """Per-thread output buffers of at least ``elements`` entries (reused, grown when short)."""
    cached: dict[int, tuple[np.ndarray, np.ndarray]] = getattr(_local, "scratch", {})
    _local.scratch = cached
    held = cached.get(element.itemsize)
    if held is None or held[0].size < elements:
        held = cached[element.itemsize] = (
            np.empty(elements, dtype=np.int64),
            np.empty(elements, dtype=element),
        )
    return held


def diff_range(
    base: np.ndarray,
    new: np.ndarray,
    *,
    element: np.dtype[np.unsignedinteger],
    start: int,
    chunk_words: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Indices and new bits of the elements where ``new`` differs from ``base``, per chunk.

    Args:
        base: baseline words (unsigned; read only).
        new: new words, same dtype and size.
        element: the unsigned dtype of the elements; words hold a whole number of them.
        start: index of ``base[0]`` among its unit's words (indices are unit-relative).
        chunk_words: words compared per call of the kernel (bounds the scratch).

    Returns:
        Per chunk with changes, in order: int64 element indices (ascending) and the new bits.
    """
    per = base.itemsize // element.itemsize
    indices, values = _scratch(min(chunk_words, base.size) * per, element)
    parts = []
    for a in range(0, base.size, chunk_words):
        b, n = base[a : a + chunk_words], new[a : a + chunk_words]
        count = _collect(b, n, b.view(element), n.view(element), per, indices, values)
        if count:
            found = indices[:count] + (start + a) * per
            parts.append((found, values[:count].copy()))
    return parts
