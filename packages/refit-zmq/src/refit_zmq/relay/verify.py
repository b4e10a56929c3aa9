"""Sampled read-back: after applying, re-read some written entries and compare with the payload.

The checksum proves the bytes arrived as sent; the read-back proves they landed where the
receiver serves them (a wrong view, an engine that copied the tensor, a device write that
failed silently). ``verification_candidates`` entries are drawn among every element the
payload carries, in proportion to each item's count.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from refit_core.errors import VerificationError
from refit_zmq.codec.buffers import unpack_buffer
from refit_zmq.codec.dtypes import int_view, unsigned_numpy_dtype
from refit_zmq.codec.format import DecodedItem, DecodedPayload
from refit_zmq.codec.locations import decode_locations

__all__ = ["verify_sample"]


def _positions(item: DecodedItem, picks: np.ndarray) -> np.ndarray:
    """Row-major element indices in the tensor of the item's entries ``picks``."""
    header = item.header
    raw = None if item.locations is None else unpack_buffer(item.locations)
    span_indices = decode_locations(header, raw)
    relative = header.first + picks if span_indices is None else span_indices[picks]
    return np.asarray(relative, dtype=np.int64) + header.span_start


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


def verify_sample(
    decoded: DecodedPayload,
    tensors: Mapping[str, torch.Tensor],
    candidates: int,
    rng: np.random.Generator,
) -> int:
    """Compare up to ``candidates`` carried entries with what ``tensors`` hold; return how many.

    Raises:
        VerificationError: an entry differs from the value the payload carries.
    """
    items = [item for item in decoded.items if item.values is not None and item.header.count]
    total = sum(item.header.count for item in items)
    if candidates <= 0 or total == 0:
        return 0
    draws = rng.choice(total, size=min(candidates, total), replace=False)
    bounds = np.cumsum([item.header.count for item in items])
    owners = np.searchsorted(bounds, draws, side="right")
    checked = 0
    for owner in np.unique(owners):
        item = items[int(owner)]
        assert item.values is not None
        start = int(bounds[owner]) - item.header.count
        picks = np.sort(draws[owners == owner] - start)
        width = unsigned_numpy_dtype(item.header.itemsize)
        sent = unpack_buffer(item.values).view(width)[picks]
        held = _held(tensors[item.header.name], _positions(item, picks))
        wrong = np.flatnonzero(sent != held)
        if wrong.size:
            raise VerificationError(
                f"tensor {item.header.name!r}: {wrong.size} of {picks.size} sampled entries "
                "differ from the payload after apply"
            )
        checked += int(picks.size)
    return checked
