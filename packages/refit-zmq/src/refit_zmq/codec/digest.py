"""Per-tensor digest of the bits a receiver holds, for end-to-end verification."""

from __future__ import annotations

import torch
import xxhash

from refit_zmq.codec.dtypes import int_view
from refit_zmq.codec.spans import read_span

__all__ = ["DIGEST_BLOCK_BYTES", "tensor_digest"]

DIGEST_BLOCK_BYTES = 16 << 20
"""A tensor that is not a contiguous CPU tensor is hashed through a host buffer of this size."""


def tensor_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of ``"{dtype}|{shape}|"`` then the raw element bits in row-major order.

    Bitwise (NaN payloads and -0.0 count), independent of layout and device; the same
    definition as the trainer-side ``refit_lab.digest.tensor_digest``. A contiguous CPU
    tensor is hashed in place; any other (a GPU tensor, a strided view) block by block
    through one host buffer of at most :data:`DIGEST_BLOCK_BYTES`, so no copy of the whole
    tensor is ever made. (Every byte still crosses to the host: xxh3 runs there.)
    """
    hasher = xxhash.xxh3_64()
    hasher.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    bits = int_view(tensor.detach())
    numel = bits.numel()
    if bits.device.type == "cpu" and bits.is_contiguous():
        hasher.update(bits.reshape(-1).numpy().view("u1").data)
    elif numel:
        block = max(1, DIGEST_BLOCK_BYTES // bits.element_size())
        pinned = bits.device.type == "cuda"
        buffer = torch.empty(min(block, numel), dtype=bits.dtype, pin_memory=pinned)
        for start in range(0, numel, block):
            stop = min(numel, start + block)
            part = read_span(bits, start, stop, out=buffer[: stop - start])
            hasher.update(part.numpy().view("u1").data)
    digest: int = hasher.intdigest()
    return digest
