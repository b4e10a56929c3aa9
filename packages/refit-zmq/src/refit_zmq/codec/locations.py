"""Which elements of a span an item carries: choose, encode and decode the location encoding.

For a span of ``n`` elements of ``s`` bytes with ``k`` changed elements, the first at ``f`` and
the last at ``l``, the raw bytes each encoding puts on the wire (values included) are::

    RANGE   (l - f + 1) * s         the changed set's bounding range, unchanged elements inside
                                    it included (harmless: values are the new bits)
    GAPS    (k - 1) * w + k * s     w = narrowest of 1, 2, 4, 8 bytes holding the largest gap
    BITMAP  ceil(n / 8) + k * s
    DENSE   n * s                   RANGE when it covers the whole span

The smallest wins; ties go to the simpler one (RANGE, then GAPS, then BITMAP). Break-even
points: GAPS beats BITMAP while ``(k - 1) * w < n / 8``, i.e. below a density of
``1 / (8 * w)`` (6.25% with uint16 gaps, 12.5% with uint8 gaps, which need every gap <= 255).
BITMAP beats DENSE while ``k * s + n / 8 < n * s``, i.e. below a density of
``1 - 1 / (8 * s)`` (93.75% for bf16, 87.5% for fp8). RANGE beats GAPS when the changed set is
nearly contiguous: its bounding range holds fewer than ``k * (1 + w / s)`` elements. With
uniformly scattered changes in bf16 this puts GAPS below ~6% changed, BITMAP from there to
~94%, DENSE above; a norm vector or a slice rewritten in place goes RANGE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from refit_core import ProtocolError
from refit_zmq.codec.dtypes import unsigned_numpy_dtype
from refit_zmq.codec.format import Encoding, ItemHeader

__all__ = ["LocationPlan", "decode_locations", "encode_locations"]

_GAP_WIDTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class LocationPlan:
    """The chosen encoding and the header fields it implies."""

    encoding: Encoding
    first: int = 0
    count: int = 0
    gap_width: int = 0


def _gap_width(largest_gap: int) -> int:
    return next(w for w in _GAP_WIDTHS if largest_gap < 1 << (8 * w))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _largest_gap(indices: np.ndarray) -> int:  # pragma: no cover - compiled
    """The largest difference of neighbouring sorted indices (0 for fewer than two)."""
    largest = 0
    for i in range(1, indices.size):
        largest = max(largest, indices[i] - indices[i - 1])
    return largest


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _fill_gaps(indices: np.ndarray, gaps: np.ndarray) -> None:  # pragma: no cover - compiled
    """``gaps[i] = indices[i + 1] - indices[i]``, narrowed to ``gaps``' width (which holds
    them: the caller sized it from :func:`_largest_gap`)."""
    for i in range(gaps.size):
        gaps[i] = indices[i + 1] - indices[i]


def _bitmap(indices: np.ndarray, span_len: int) -> np.ndarray:
    mask = np.zeros(span_len, dtype=np.bool_)
    mask[indices] = True
    packed: np.ndarray = np.packbits(mask, bitorder="little")
    return packed


def encode_locations(
    indices: np.ndarray, span_len: int, itemsize: int
) -> tuple[LocationPlan, np.ndarray | None]:
    """Smallest encoding of sorted, distinct span-relative ``indices``, and its buffer.

    See the module docstring for the costs compared. The buffer is the narrow gaps for GAPS,
    the packed bits for BITMAP, and None for NONE, RANGE and DENSE.
    """
    k = int(indices.size)
    if k == 0:
        return LocationPlan(Encoding.NONE), None
    first, last = int(indices[0]), int(indices[-1])
    best = LocationPlan(Encoding.RANGE, first, last - first + 1)
    best_cost = best.count * itemsize
    if best.count == span_len:
        best = LocationPlan(Encoding.DENSE, 0, span_len)
    bitmap_cost = (span_len + 7) // 8 + k * itemsize
    least_gaps_cost = (k - 1) + k * itemsize  # 1-byte gaps; GAPS wins a tie with BITMAP
    if least_gaps_cost < best_cost and least_gaps_cost <= bitmap_cost:
        gap_width = _gap_width(int(_largest_gap(indices)))
        gaps_cost = (k - 1) * gap_width + k * itemsize
        if gaps_cost < best_cost:
            best, best_cost = LocationPlan(Encoding.GAPS, first, k, gap_width), gaps_cost
    if bitmap_cost < best_cost:
        return LocationPlan(Encoding.BITMAP, 0, k), _bitmap(indices, span_len)
    if best.encoding is Encoding.GAPS:
        gaps = np.empty(k - 1, dtype=unsigned_numpy_dtype(best.gap_width))
        _fill_gaps(indices, gaps)
        return best, gaps
    return best, None


def decode_locations(item: ItemHeader, raw: np.ndarray | None) -> np.ndarray | None:
    """Span-relative int64 indices of a GAPS or BITMAP item, validated; None for the others."""
    if item.encoding is Encoding.GAPS and raw is not None:
        gaps = raw.view(unsigned_numpy_dtype(item.gap_width))
        indices = np.empty(item.count, dtype=np.int64)
        indices[0] = item.first
        if gaps.size:
            if int(gaps.min()) < 1 or int(gaps.max()) >= item.span_len:
                raise ProtocolError(f"item {item.name!r}: gap out of range")
            np.cumsum(gaps, dtype=np.int64, out=indices[1:])
            indices[1:] += item.first
        if int(indices[-1]) >= item.span_len:
            raise ProtocolError(f"item {item.name!r}: index past the end of its span")
        return indices
    if item.encoding is Encoding.BITMAP and raw is not None:
        bits = np.unpackbits(raw, count=item.span_len, bitorder="little").view(np.bool_)
        found: np.ndarray = np.flatnonzero(bits)
        if found.size != item.count:
            raise ProtocolError(f"item {item.name!r}: bitmap holds {found.size}, not {item.count}")
        return found
    return None
