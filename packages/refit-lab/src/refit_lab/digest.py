"""Bitwise digests of tensors and named tensor collections (xxh3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

__all__ = ["combined_digest", "state_digest", "tensor_digest"]


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as a flat, contiguous CPU byte buffer."""
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def tensor_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of the tensor's dtype, shape and raw element bits.

    Bitwise: -0.0 and 0.0 differ, as do NaNs with different payloads. Layout does not
    matter (a non-contiguous tensor hashes like its contiguous copy), but dtype and shape do.
    """
    hasher = xxhash.xxh3_64()
    hasher.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    hasher.update(_raw_bytes(tensor))
    digest: int = hasher.intdigest()
    return digest


def state_digest(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Per-name :func:`tensor_digest`; a repeated name raises ``ValueError``."""
    digests: dict[str, int] = {}
    for name, tensor in named:
        if name in digests:
            raise ValueError(f"duplicate tensor name {name!r}")
        digests[name] = tensor_digest(tensor)
    return digests


def combined_digest(digests: Mapping[str, int]) -> str:
    """Hex xxh3-128 over the name-sorted ``(name, digest)`` pairs; independent of order."""
    hasher = xxhash.xxh3_128()
    for name in sorted(digests):
        encoded = name.encode()
        hasher.update(len(encoded).to_bytes(8, "little"))
        hasher.update(encoded)
        hasher.update(digests[name].to_bytes(8, "little"))
    result: str = hasher.hexdigest()
    return result
