"""Sampled read-back: after applying, re-read some written entries and compare with the payload.

The checksum proves the bytes arrived as sent; the read-back proves they landed where the
receiver serves them (a wrong view, an engine that copied the tensor, a device write that
failed silently). ``verification_candidates`` entries are drawn among every element the
payload carries, in proportion to each item's count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from refit_core import VerificationError
from refit_zmq.codec import ItemHeader, decode_locations
from refit_zmq.codec.dtypes import int_view, unsigned_numpy_dtype

__all__ = ["check_held", "draw_picks", "entry_positions"]


def draw_picks(
    counts: Sequence[int], candidates: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per item, the sorted entries (indices into its values) to re-read: up to ``candidates``
    drawn without replacement among all ``sum(counts)`` entries."""
    total = sum(counts)
    if candidates <= 0 or total == 0:
        return [np.empty(0, dtype=np.int64) for _ in counts]
    draws = rng.choice(total, size=min(candidates, total), replace=False)
    ends = np.cumsum(counts)
    owners = np.searchsorted(ends, draws, side="right")
    return [
        np.sort(draws[owners == index] - (int(ends[index]) - count)).astype(np.int64)
        for index, count in enumerate(counts)
    ]


def entry_positions(
    item: ItemHeader, locations: np.ndarray | None, picks: np.ndarray
) -> np.ndarray:
    """Row-major element indices in the tensor of the item's entries ``picks`` (``locations``:
    the raw locations buffer of a GAPS or BITMAP item)."""
    span_indices = decode_locations(item, locations)
    relative = item.first + picks if span_indices is None else span_indices[picks]
    return np.asarray(relative, dtype=np.int64) + item.span_start


def _held(tensor: torch.Tensor, flat: np.ndarray) -> np.ndarray:
    """The receiver's bits at row-major indices ``flat`` (no copy of the whole tensor)."""
    bits = int_view(tensor.detach())
    if bits.dim() <= 1:
        picked = bits.reshape(-1)[torch.from_numpy(flat)]
    else:
        index = np.unravel_index(flat, tuple(bits.shape))
        picked = bits[tuple(torch.from_numpy(np.ascontiguousarray(i)) for i in index)]
    held: np.ndarray = picked.cpu().numpy().view(unsigned_numpy_dtype(tensor.element_size()))
    return held


def check_held(name: str, tensor: torch.Tensor, positions: np.ndarray, sent: np.ndarray) -> int:
    """Compare the bits ``tensor`` holds at ``positions`` with ``sent``; return how many.

    Raises:
        VerificationError: an entry differs from the value the payload carries.
    """
    if positions.size == 0:
        return 0
    held = _held(tensor, positions)
    wrong = np.flatnonzero(sent.view(held.dtype) != held)
    if wrong.size:
        raise VerificationError(
            f"tensor {name!r}: {wrong.size} of {positions.size} sampled entries "
            "differ from the payload after apply"
        )
    return int(positions.size)
