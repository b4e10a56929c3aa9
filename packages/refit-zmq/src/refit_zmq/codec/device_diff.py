"""The device change detection: compare, index extraction and gather with torch ops, where the
tensors are (a GPU, or any device; the same code runs on CPU tensors in the tests).

Bits are compared as 64-bit words first where both sides allow it (one compare and one
``nonzero`` over a quarter of the bf16 elements, a mask of an eighth of the bytes), then the
elements of the changed words only. Only the changed elements' indices (int32 when the span
allows) and new bits leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["HostDiff", "diff_on_device", "fetch_diff"]

_WORD = 8
_INT32_LIMIT = 1 << 31


def _as_words(bits: torch.Tensor) -> torch.Tensor | None:
    """``bits`` (flat, contiguous) as int64 words, or None where its size or address forbids."""
    if bits.element_size() == _WORD or bits.numel() * bits.element_size() % _WORD:
        return None
    if bits.data_ptr() % _WORD:
        return None
    return bits.view(torch.int64)


def diff_on_device(base: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending int64 indices and new bits of the elements where ``new`` differs from ``base``.

    Both are flat, contiguous integer tensors of one dtype and size on one device; the result
    stays on that device.
    """
    if base.shape != new.shape or base.dtype != new.dtype or base.device != new.device:
        raise ValueError("baseline and new bits differ in size, dtype or device")
    base_words, new_words = _as_words(base), _as_words(new)
    if base_words is None or new_words is None:
        indices = torch.nonzero(base != new).view(-1)
        return indices, new.index_select(0, indices)
    per = _WORD // new.element_size()
    words = torch.nonzero(base_words != new_words).view(-1)
    base_lanes = base.view(-1, per).index_select(0, words)
    new_lanes = new.view(-1, per).index_select(0, words)
    changed = base_lanes != new_lanes
    lanes = torch.arange(per, device=new.device)
    indices = (words.unsqueeze(1) * per + lanes)[changed]
    return indices, new_lanes[changed]


@dataclass(frozen=True)
class HostDiff:
    """The changed elements of one device compare, on the host.

    Attributes:
        indices: span-relative indices, ascending (int32 where the span allows, else int64).
        values: the new bits of those elements (numpy, the tensor's integer width).
        to_host_bytes: bytes that crossed from the device (indices sent as int32 where the
            span allows).
    """

    indices: np.ndarray
    values: np.ndarray
    to_host_bytes: int


def fetch_diff(base: torch.Tensor, new: torch.Tensor) -> HostDiff:
    """:func:`diff_on_device`, then only its indices and values copied to the host."""
    indices, values = diff_on_device(base, new)
    narrow = indices.to(torch.int32) if new.numel() < _INT32_LIMIT else indices
    host_indices, host_values = narrow.cpu(), values.cpu()
    return HostDiff(
        host_indices.numpy(), host_values.numpy(), host_indices.nbytes + host_values.nbytes
    )
