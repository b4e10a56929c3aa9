"""Declared geometry against vLLM's defaults."""

from __future__ import annotations

import sys
import types

import pytest

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec
from refit_nccl.transfer.geometry import (
    VLLM_DOCUMENTED_GEOMETRY,
    installed_vllm_geometry,
    require_vllm_defaults,
)

MiB = 1024 * 1024


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm.distributed.weight_transfer.packed_tensor")
    module.DEFAULT_PACKED_BUFFER_SIZE_BYTES = 512 * MiB  # type: ignore[attr-defined]
    module.DEFAULT_PACKED_NUM_BUFFERS = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_installed_defaults_are_read(fake_vllm: types.ModuleType) -> None:
    assert installed_vllm_geometry() == CollectiveSenderSpec("vllm", 512 * MiB, 3)
    assert require_vllm_defaults(CollectiveSenderSpec("vllm", 512 * MiB, 3)).num_buffers == 3
    with pytest.raises(GeometryMismatchError, match="the installed vLLM"):
        require_vllm_defaults(VLLM_DOCUMENTED_GEOMETRY)


def test_documented_defaults_apply_without_vllm() -> None:
    if installed_vllm_geometry() is not None:
        pytest.skip("vLLM is installed here")
    assert require_vllm_defaults(VLLM_DOCUMENTED_GEOMETRY) == VLLM_DOCUMENTED_GEOMETRY
    with pytest.raises(GeometryMismatchError, match="documented defaults"):
        require_vllm_defaults(CollectiveSenderSpec("vllm", 64 * MiB, 2))


def test_other_peers_are_not_vllm_receivers() -> None:
    with pytest.raises(GeometryMismatchError, match="peer 'refit'"):
        require_vllm_defaults(CollectiveSenderSpec("refit", 64 * MiB, 2))
