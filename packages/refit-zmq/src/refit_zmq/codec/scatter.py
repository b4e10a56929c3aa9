"""Gather, scatter and range copies on flat integer tensors, by numpy on CPU, torch elsewhere.

torch's CPU ``index_copy_`` / ``index_put_`` fan out to the intra-op thread pool even for a
few thousand indices, which measured 5-15x slower than numpy's single-threaded fancy
indexing on this project's 2-core machines (and far worse when the cores are shared), so CPU
tensors go through numpy views of the same memory. Plain range copies (``copy_``, ``clone``)
fan out the same way: 4-5x slower than one numpy memcpy with the two cores shared.
"""

from __future__ import annotations

import torch

__all__ = ["gather", "read_range", "scatter", "write_range"]


def gather(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``flat[positions]``."""
    if flat.device.type == "cpu":
        return torch.from_numpy(flat.numpy()[positions.numpy()])
    return flat.index_select(0, positions)


def scatter(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[positions] = values``, in place."""
    if flat.device.type == "cpu":
        flat.numpy()[positions.numpy()] = values.numpy()
    else:
        flat.index_copy_(0, positions, values)


def read_range(flat: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """A new tensor of ``flat[start : start + count]``."""
    if flat.device.type == "cpu":
        return torch.from_numpy(flat.numpy()[start : start + count].copy())
    return flat[start : start + count].clone()


def write_range(flat: torch.Tensor, start: int, values: torch.Tensor) -> None:
    """``flat[start : start + len(values)] = values``, in place."""
    end = start + values.numel()
    if flat.device.type == "cpu":
        flat.numpy()[start:end] = values.numpy()
    else:
        flat[start:end].copy_(values)
