"""Per-tensor digest of the bits a receiver holds, for end-to-end verification."""

from __future__ import annotations

import torch
import xxhash

from refit_zmq.codec.dtypes import int_view

__all__ = ["tensor_digest"]


def tensor_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of ``"{dtype}|{shape}|"`` then the raw element bits in row-major order.

    Bitwise (NaN payloads and -0.0 count), independent of layout and device; the same
    definition as the trainer-side ``refit_lab.digest.tensor_digest``.
    """
    hasher = xxhash.xxh3_64()
    hasher.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    bits = int_view(tensor.detach()).cpu().contiguous().reshape(-1)
    hasher.update(bits.numpy().view("u1").data)
    digest: int = hasher.intdigest()
    return digest
