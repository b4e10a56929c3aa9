"""Checkpoint specs from safetensors headers: floating dtypes as served, others as stored."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from refit_core.checkpoint import checkpoint_specs
from refit_core.errors import GeometryMismatchError


def _write(path: Path, header: dict[str, object]) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body)


def test_specs_of_every_file(tmp_path: Path) -> None:
    _write(
        tmp_path / "a.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        },
    )
    _write(
        tmp_path / "b.safetensors",
        {"ids": {"dtype": "I64", "shape": [4], "data_offsets": [0, 32]}},
    )
    assert checkpoint_specs(str(tmp_path), "bfloat16") == {
        "w": ((2, 3), "bfloat16"),
        "ids": ((4,), "int64"),
    }


def test_missing_checkpoint_and_unknown_dtype_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GeometryMismatchError, match="no \\*.safetensors"):
        checkpoint_specs(str(tmp_path), "bfloat16")
    _write(tmp_path / "c.safetensors", {"x": {"dtype": "C64", "shape": [1]}})
    with pytest.raises(GeometryMismatchError, match="C64"):
        checkpoint_specs(str(tmp_path), "bfloat16")
