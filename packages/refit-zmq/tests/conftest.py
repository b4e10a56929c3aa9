"""Shared test data for refit-zmq: hypothesis profiles and random states with given bits.

``REFIT_HYPOTHESIS_PROFILE=full`` runs the property tests with many more examples than the
default profile, which keeps the package's default run short on a 2-core machine.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "refit",
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "refit-full",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(
    "refit-full" if os.environ.get("REFIT_HYPOTHESIS_PROFILE") == "full" else "refit"
)

_SPECIAL_BITS: dict[int, tuple[int, ...]] = {
    # +0, -0, smallest subnormals, +inf, -inf, NaNs with different payloads and signs
    2: (0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFC3, 0x7C00, 0x7E01),
    4: (0x00000000, 0x80000000, 0x00000001, 0x7F800000, 0x7FC00000, 0x7FC00001, 0xFFC00005),
    8: (0, 1 << 63, 1, 0x7FF0000000000000, 0x7FF8000000000000, 0x7FF8000000000001),
    1: (0x00, 0x80, 0x01, 0x7F, 0xFF, 0x7E),
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A same-width integer view (contiguous copy) for exact comparisons."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(width[tensor.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit patterns."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Uniformly random bit patterns (0/1 for bool) of ``shape`` and ``dtype``."""
    numel = int(np.prod(shape, dtype=np.int64))
    size = torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = rng.integers(0, 2, numel, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, numel * size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def changed(
    rng: np.random.Generator, old: torch.Tensor, density: float, *, special: bool
) -> torch.Tensor:
    """A copy of ``old`` with about ``density`` of its elements given other bits.

    With ``special``, replacements come from -0.0, subnormals, infinities and NaN payloads
    (for floats; boundary values for integers), which a value compare would miss or mangle.
    """
    new = old.clone()
    flat = bits(new).view(-1)
    hit = torch.from_numpy(rng.random(flat.numel()) < density)
    count = int(hit.sum())
    if count == 0:
        return new
    if old.dtype == torch.bool:
        flat[hit] ^= 1
        return new
    fresh = bits(random_tensor(rng, (count,), old.dtype))
    if special:
        pool = np.array(_SPECIAL_BITS[old.element_size()], dtype=np.uint64)
        picks = pool[rng.integers(0, len(pool), count)].astype(np.int64)
        fresh = torch.from_numpy(picks).to(fresh.dtype)
    flat[hit] = fresh
    return new


def non_contiguous(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in a non-contiguous view (``layout``: contiguous, transposed, strided)."""
    if layout == "transposed" and tensor.dim() >= 2:
        return tensor.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided" and tensor.numel():
        wide = torch.empty((tensor.numel(), 2), dtype=tensor.dtype)
        wide[:, 0] = tensor.reshape(-1)
        view = wide[:, 0].reshape(tensor.shape)
        assert not view.is_contiguous() or tensor.numel() == 1
        return view
    return tensor


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """Data helpers for the tests (tests cannot import conftest under importlib mode)."""
    return SimpleNamespace(
        bits=bits,
        same_bits=same_bits,
        random_tensor=random_tensor,
        changed=changed,
        non_contiguous=non_contiguous,
    )
