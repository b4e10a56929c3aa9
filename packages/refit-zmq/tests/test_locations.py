"""Location encodings: the smallest one wins, and decoding validates what it reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refit_core import ProtocolError, WeightVersion
from refit_zmq.codec.format import Encoding, ItemHeader
from refit_zmq.codec.locations import LocationPlan, decode_locations, encode_locations


def _indices(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def plan_locations(indices: np.ndarray, span_len: int, itemsize: int) -> LocationPlan:
    return encode_locations(indices, span_len, itemsize)[0]


def _header(
    plan_encoding: Encoding, span_len: int, first: int, count: int, width: int
) -> ItemHeader:
    return ItemHeader(
        name="t",
        dtype=torch.bfloat16,
        shape=(span_len,),
        span_start=0,
        span_stop=span_len,
        encoding=plan_encoding,
        first=first,
        count=count,
        gap_width=width,
        base=WeightVersion(0),
        target=WeightVersion(1),
    )


def test_nothing_changed_is_none() -> None:
    assert plan_locations(_indices(), 100, 2).encoding is Encoding.NONE


def test_contiguous_run_is_a_range() -> None:
    plan = plan_locations(np.arange(10, 30, dtype=np.int64), 1000, 2)
    assert (plan.encoding, plan.first, plan.count) == (Encoding.RANGE, 10, 20)


def test_whole_span_is_dense() -> None:
    plan = plan_locations(np.arange(64, dtype=np.int64), 64, 2)
    assert (plan.encoding, plan.first, plan.count) == (Encoding.DENSE, 0, 64)


@pytest.mark.parametrize(("largest_gap", "width"), [(255, 1), (256, 2), (65535, 2), (65536, 4)])
def test_gaps_use_the_narrowest_width(largest_gap: int, width: int) -> None:
    indices = np.concatenate([np.arange(0, 2000, 10), [1990 + largest_gap]]).astype(np.int64)
    plan = plan_locations(indices, 1 << 40, 2)
    assert plan.encoding is Encoding.GAPS
    assert plan.gap_width == width
    gaps = encode_locations(indices, 1 << 40, 2)[1]
    assert gaps is not None and gaps.itemsize == width


def test_gap_width_eight_for_huge_spans() -> None:
    indices = _indices(0, 1, 2, 1 << 33)
    plan = plan_locations(indices, 1 << 34, 2)
    assert (plan.encoding, plan.gap_width) == (Encoding.GAPS, 8)


def test_sparse_scatter_is_gaps_and_dense_scatter_is_bitmap() -> None:
    rng = np.random.default_rng(0)
    n = 100_000
    sparse = np.flatnonzero(rng.random(n) < 0.01)
    dense = np.flatnonzero(rng.random(n) < 0.3)
    assert plan_locations(sparse, n, 2).encoding is Encoding.GAPS
    assert plan_locations(dense, n, 2).encoding is Encoding.BITMAP


def test_a_tie_between_gaps_and_bitmap_goes_to_gaps() -> None:
    # 16 bf16 elements, 3 changed: GAPS 2 * 1 + 3 * 2 = 8 bytes, BITMAP 2 + 3 * 2 = 8 bytes
    plan, _ = encode_locations(np.array([3, 4, 12]), 16, 2)
    assert plan == LocationPlan(Encoding.GAPS, 3, 3, 1)


def test_break_even_between_gaps_and_bitmap_follows_the_arithmetic() -> None:
    # uint16 gaps (one gap of 300 forces the width) cost 2 bytes per change, a bitmap n / 8
    # bytes: they break even at a density of 1/16.
    n = 1 << 16

    def spaced(step: int) -> np.ndarray:
        regular = np.arange(0, n - 400, step, dtype=np.int64)
        return np.append(regular, regular[-1] + 300)

    below, above = spaced(20), spaced(12)
    assert plan_locations(below, n, 2).encoding is Encoding.GAPS
    assert plan_locations(above, n, 2).encoding is Encoding.BITMAP


@pytest.mark.parametrize("density", [0.001, 0.05, 0.3, 0.9])
def test_locations_roundtrip(density: float) -> None:
    rng = np.random.default_rng(1)
    n = 5000
    indices = np.flatnonzero(rng.random(n) < density)
    plan, raw = encode_locations(indices, n, 2)
    header = _header(plan.encoding, n, plan.first, plan.count, plan.gap_width)
    decoded = decode_locations(header, None if raw is None else raw.view(np.uint8))
    if plan.encoding in (Encoding.GAPS, Encoding.BITMAP):
        assert decoded is not None
        np.testing.assert_array_equal(decoded, indices)
    else:
        assert decoded is None


def test_decoding_rejects_a_gap_past_the_span() -> None:
    header = _header(Encoding.GAPS, 100, 10, 3, 1)
    with pytest.raises(ProtocolError, match="past the end|out of range"):
        decode_locations(header, np.array([50, 60], dtype=np.uint8))


def test_decoding_rejects_a_zero_gap() -> None:
    header = _header(Encoding.GAPS, 100, 10, 3, 1)
    with pytest.raises(ProtocolError, match="gap out of range"):
        decode_locations(header, np.array([0, 5], dtype=np.uint8))


def test_decoding_rejects_a_bitmap_with_the_wrong_count() -> None:
    header = _header(Encoding.BITMAP, 16, 0, 3, 0)
    with pytest.raises(ProtocolError, match="bitmap"):
        decode_locations(header, np.array([0b101, 0], dtype=np.uint8))
