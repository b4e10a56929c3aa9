"""The change-detection kernel against a per-element reference, on every word/element pairing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refit_zmq.codec.diff import diff_range
from refit_zmq.codec.dtypes import int_view, unsigned_numpy_dtype

WIDTHS = (1, 2, 4, 8)


def _reference(base: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    indices = np.flatnonzero(base != new)
    return indices, new[indices]


def flat_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bits as a flat unsigned array sharing its memory."""
    array: np.ndarray = int_view(tensor).reshape(-1).numpy()
    return array.view(unsigned_numpy_dtype(tensor.element_size()))


def _run(
    base: np.ndarray, new: np.ndarray, *, word: int, start: int
) -> tuple[np.ndarray, np.ndarray]:
    """diff_range over ``base``/``new`` (element arrays) read as ``word``-byte words."""
    words = unsigned_numpy_dtype(word)
    return diff_range(base.view(words), new.view(words), element=base.dtype, start=start)


@given(
    element=st.sampled_from(WIDTHS),
    word=st.sampled_from(WIDTHS),
    words=st.integers(0, 300) | st.integers(2040, 4200),
    density=st.sampled_from((0.0, 0.01, 0.3, 1.0)),
    start=st.integers(0, 1000),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_finds_exactly_the_changed_elements(
    element: int, word: int, words: int, density: float, start: int, seed: int
) -> None:
    """Ranges within one block and across blocks (2048 words), output growth included."""
    word = max(word, element)
    rng = np.random.default_rng(seed)
    dtype = unsigned_numpy_dtype(element)
    n = words * (word // element)
    base = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    new = base.copy()
    hit = rng.random(n) < density
    new[hit] ^= rng.integers(1, np.iinfo(dtype).max, int(hit.sum()), dtype=dtype, endpoint=True)
    indices, values = _run(base, new, word=word, start=start)
    want_indices, want_values = _reference(base, new)
    assert np.array_equal(indices, want_indices + start * (word // element))
    assert np.array_equal(values, want_values)


@pytest.mark.parametrize("words", [8 * 8 + 3, 2048 + 8 * 8 + 3])
def test_last_partial_cache_line_is_compared(words: int) -> None:
    base = np.zeros(words, dtype=np.uint64)
    new = base.copy()
    new[-1] = 1 << 63
    indices, values = _run(base, new, word=8, start=0)
    assert indices.tolist() == [base.size - 1]
    assert values.tolist() == [1 << 63]


FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8 = tuple(
    d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d
)


@pytest.mark.parametrize("dtype", FLOATS)
def test_bit_patterns_that_compare_equal_as_values_are_changes(dtype: torch.dtype) -> None:
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0, 0.0, 0.0, 0.0, 0.0], dtype=dtype)
    new = torch.tensor([-0.0, float("nan"), 1.0, 2.0, 0.0, 0.0, 0.0, 0.0], dtype=dtype)
    new_bits = flat_bits(new)
    new_bits[1] ^= new_bits.dtype.type(1)  # another NaN payload: NaN as values, other bits
    indices, values = _run(flat_bits(base), new_bits, word=8, start=0)
    assert indices.tolist() == [0, 1]
    assert np.array_equal(values, new_bits[:2])


@pytest.mark.parametrize("dtype", [*FP8, torch.int8, torch.uint8, torch.int16, torch.int32])
def test_narrow_and_integer_elements_in_64_bit_words(dtype: torch.dtype) -> None:
    base = torch.randint(-100, 100, (40,), generator=torch.Generator().manual_seed(0))
    base = base.to(torch.float32).to(dtype) if dtype in FP8 else base.to(dtype)
    new = base.clone()
    changed = [0, 9, base.numel() - 1]
    flat_bits(new)[changed] ^= 1
    word = 8 if base.nbytes % 8 == 0 else dtype.itemsize
    indices, values = _run(flat_bits(base), flat_bits(new), word=word, start=0)
    assert indices.tolist() == changed
    assert np.array_equal(values, flat_bits(new)[changed])


_COMPILED_AFTER_A_TRACKER = """
import torch
from refit_core import TensorSpec
from refit_zmq.codec import diff
from refit_zmq.tracker.delta_tracker import DeltaCompressionTracker, TrackerConfig

spec = {"a": TensorSpec((64,), "bfloat16"), "b": TensorSpec((64,), "float32")}
assert not diff._collect.signatures, "nothing compiled before a tracker is built"
DeltaCompressionTracker(spec, TrackerConfig(threads=1)).close()
print(sorted({str(signature[2]) for signature in diff._collect.signatures}))
"""


def test_a_tracker_compiles_the_kernel_for_its_element_widths_when_it_is_built() -> None:
    """The first delta of a process would otherwise pay for the compile (3-4 s; 0.5 s from
    numba's cache), as the first refit on an engine."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _COMPILED_AFTER_A_TRACKER],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "uint16" in out and "uint32" in out, out
