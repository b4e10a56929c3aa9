"""Tensors as a communicator moves them: their storage as flat bytes."""

from __future__ import annotations

import torch

__all__ = ["wire_view"]


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)
