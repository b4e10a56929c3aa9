"""Row-major element spans of tensors of any layout, read without touching anything else.

A producer owns items (spans of a tensor's row-major elements) and must read only their
bytes: a contiguous tensor's span is a slice of its flat view; a non-contiguous tensor's span
is cut into at most ``2 * ndim - 1`` strided views (a partial leading row, whole rows, a partial
trailing row, recursively), each copied as it is, so neither the whole tensor nor a
contiguous copy of it is ever made.
"""

from __future__ import annotations

import torch

__all__ = ["read_span", "span_views"]


def span_views(tensor: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
    """Views of ``tensor`` that hold its row-major elements ``[start, stop)``, in order."""
    if not 0 <= start <= stop <= tensor.numel():
        raise ValueError(f"span [{start}, {stop}) outside a tensor of {tensor.numel()} elements")
    if start == stop:
        return []
    if tensor.is_contiguous():
        return [tensor.reshape(-1)[start:stop]]
    if tensor.dim() == 1:
        return [tensor[start:stop]]
    inner = tensor.numel() // tensor.shape[0]
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        row_start = first_row * inner
        return span_views(tensor[first_row], start - row_start, stop - row_start)
    views: list[torch.Tensor] = []
    whole_from = first_row
    if start % inner:
        views += span_views(tensor[first_row], start % inner, inner)
        whole_from += 1
    whole_to = last_row + 1 if stop % inner == 0 else last_row
    if whole_to > whole_from:
        views.append(tensor[whole_from:whole_to])
    if stop % inner:
        views += span_views(tensor[last_row], 0, stop % inner)
    return views


def read_span(
    tensor: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The row-major elements ``[start, stop)`` of ``tensor`` as a flat contiguous tensor.

    A slice of the tensor itself when that is already contiguous (no copy); otherwise a copy
    of exactly those elements, into ``out`` (flat, same dtype, ``stop - start`` elements, any
    device) when given, else into a new tensor on the tensor's device.
    """
    views = span_views(tensor, start, stop)
    if out is None and len(views) == 1 and views[0].is_contiguous():
        return views[0].reshape(-1)
    if out is None:
        out = torch.empty(stop - start, dtype=tensor.dtype, device=tensor.device)
    at = 0
    for view in views:
        out[at : at + view.numel()].view(view.shape).copy_(view)
        at += view.numel()
    return out
