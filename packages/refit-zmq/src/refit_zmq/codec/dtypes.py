"""Dtypes the codec carries, their wire codes, and bit-pattern views of tensors.

Every comparison and copy in the codec works on same-width unsigned integer views of the
element bits, never on values, so NaN payloads, -0.0 and subnormals survive untouched.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "WIRE_DTYPES",
    "dtype_code",
    "dtype_from_code",
    "int_dtype",
    "int_view",
    "unsigned_numpy_dtype",
]

WIRE_DTYPES: tuple[str, ...] = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "uint16",
    "uint32",
    "uint64",
)
"""Wire code of a dtype is its position here; append only, never reorder."""

_INT_BY_SIZE: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_UNSIGNED_BY_SIZE: dict[int, np.dtype[np.unsignedinteger]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def _bare_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``; ``ValueError`` for a dtype the codec does not carry."""
    name = _bare_name(dtype)
    try:
        return WIRE_DTYPES.index(name)
    except ValueError:
        raise ValueError(f"dtype {name} is not supported by the delta codec") from None


def dtype_from_code(code: int) -> torch.dtype:
    """The torch dtype of a wire code; ``ValueError`` when unknown or absent from this torch."""
    if not 0 <= code < len(WIRE_DTYPES):
        raise ValueError(f"unknown dtype code {code}")
    dtype = getattr(torch, WIRE_DTYPES[code], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {WIRE_DTYPES[code]} is not available in this torch")
    return dtype


def unsigned_numpy_dtype(itemsize: int) -> np.dtype[np.unsignedinteger]:
    """The numpy unsigned integer dtype of ``itemsize`` bytes."""
    return _UNSIGNED_BY_SIZE[itemsize]


def int_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch integer dtype as wide as ``dtype`` (``ValueError`` if the codec lacks it)."""
    dtype_code(dtype)
    return _INT_BY_SIZE[dtype.itemsize]


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted as the torch integer dtype of the same width (no copy)."""
    return tensor.view(int_dtype(tensor.dtype))
