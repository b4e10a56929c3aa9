"""The one cast from the trainer's dtype to the engine's dtype.

Rule: a tensor in a 16-to-64-bit floating dtype is cast to the engine's dtype exactly once, by
:func:`cast_once` (``Tensor.to``: round to nearest even, elementwise and deterministic on CPU
and GPU). Integer tensors, already-quantized FP8 tensors and scale companions keep their
dtype. Every downstream step (delta, digest, wire, engine) sees the cast tensor, never the
trainer's, so the bits that are hashed are the bits the engine loads. Because the cast is
elementwise, casting a shard and then gathering gives the same bits as gathering and then
casting; sharded sources cast before they gather, which also shrinks the gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ENGINE_DTYPES", "cast_once", "cast_target", "check_engine_dtype"]

ENGINE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
"""Engine dtypes a source may cast to; FP8 needs scales, so the trainer quantizes itself."""


def check_engine_dtype(dtype: str | None) -> None:
    """Raise ValueError unless ``dtype`` is None or one of :data:`ENGINE_DTYPES`."""
    if dtype is not None and dtype not in ENGINE_DTYPES:
        raise ValueError(
            f"engine dtype must be one of {sorted(ENGINE_DTYPES)} or None, got {dtype!r}; "
            "quantize in the trainer and send the scales as companions"
        )


def cast_target(tensor_dtype: str, engine_dtype: str | None) -> str:
    """The dtype name a trainer tensor of ``tensor_dtype`` reaches the engine in."""
    if engine_dtype is None or tensor_dtype not in ENGINE_DTYPES:
        return tensor_dtype
    return engine_dtype


def cast_once(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """``tensor`` detached and cast to ``dtype`` (no copy when it already has that dtype)."""
    import torch

    return tensor.detach().to(getattr(torch, dtype))
