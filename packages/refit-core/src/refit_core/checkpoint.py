"""The checkpoint-format tensors an engine accepts, read from its safetensors headers.

A safetensors file starts with the little-endian length of a JSON header that names every
tensor's dtype and shape; only that header is read (stdlib only). Receivers inside vLLM use it
to check a trainer's state against the engine's checkpoint before any byte moves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from refit_core.errors import GeometryMismatchError

__all__ = ["checkpoint_specs"]

_MAX_HEADER_BYTES = 100 << 20
_FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})
_DTYPES = {
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def checkpoint_specs(model_dir: str, served_dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> ``(shape, dtype name)`` of a local safetensors checkpoint.

    Floating tensors are reported in ``served_dtype`` (the dtype vLLM loads them as); only
    headers are read.

    Raises:
        GeometryMismatchError: no safetensors files in ``model_dir``, or an unknown dtype.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise GeometryMismatchError(
            f"no *.safetensors checkpoint in {model_dir!r}: a refit receiver needs the "
            "engine's model as a local directory"
        )
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        for name, entry in _header(path).items():
            if name == "__metadata__":
                continue
            code = entry["dtype"]
            dtype = served_dtype if code in _FLOAT_CODES else _DTYPES.get(code)
            if dtype is None:
                raise GeometryMismatchError(f"{name}: unsupported checkpoint dtype {code}")
            specs[name] = (tuple(int(d) for d in entry["shape"]), dtype)
    return specs


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > _MAX_HEADER_BYTES:
            raise GeometryMismatchError(f"{path}: implausible safetensors header ({length} B)")
        header: dict[str, Any] = json.loads(handle.read(length))
    return header
