"""Fixtures of the engine tier: tiny Qwen2 checkpoints and the oracle of every engine test.

Each receiver's test module starts its own engines (tensor-parallel sizes 1 and 2, one engine
at a time: five engines at once exhausted a 24 GiB machine in CI) on checkpoint B'. The first
outputs of an engine are a fresh engine's on B'. The receivers' modules (collective, IPC,
sparse) refit a model with tied embeddings (``tied_checkpoints``), whose outputs on A and B''
come from fresh engines started on them (``fresh_outputs``, once per session and size): vLLM's
own reload leaves a tied model's output layer on its old weights. The other modules' untied
model takes them from vLLM's own in-place reload of those checkpoints from disk
(``reload_weights``, the loader vLLM starts with), trusted only after reloading B' reproduced
the fresh outputs exactly on that engine.
vLLM is imported only here, lazily: without it every test of the tier skips (marker
``engine``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_helpers import Checkpoints, FreshOutputs, make_checkpoints

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The tests run functions of their own in the engines' workers (stale_kernel.py).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the demo's test first: it starts and stops engines of its own, which must not come
    on top of a module's engine."""
    items.sort(key=lambda item: "test_demo_vllm" not in item.nodeid)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return make_checkpoints(Path(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def tied_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """A, B, B' and B'' of a model whose output layer is its embedding."""
    return make_checkpoints(Path(tmp_path_factory.mktemp("tied")), tied=True)


@pytest.fixture(scope="session")
def fresh_outputs() -> FreshOutputs:
    return FreshOutputs()
