"""Fixtures of the engine tier: tiny Qwen2 checkpoints and two real vLLM engines.

Start-ups are the cost (each spawns vLLM's engine-core and worker processes), so the tier
starts one engine per receiver for the whole session and takes each one's first outputs as
the fresh-engine expectation of the checkpoint it started on:

* the collective engine (refit-nccl's receiver) starts on B' and is refitted B' -> A -> B -> B';
* the sparse engine (refit-zmq's relay receiver) starts on B and is refitted B -> A -> B -> B';
* the IPC engine (refit-zmq's colocated receiver) starts on A and is refitted A -> B -> B'.

So every "after a refit to B" is compared with a fresh engine started on B, and every
"after a refit to B'" with a fresh engine started on B'. vLLM is imported only here, lazily:
without it every test of the tier skips (marker ``engine``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_helpers import (
    Checkpoints,
    Outputs,
    generate,
    make_checkpoints,
    start_engine,
)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the demo's test first: it starts and stops engines of its own, which must not
    come on top of the three session engines below (five engines exhaust the memory of a
    24 GiB machine: vLLM refused the fifth KV cache in CI)."""
    items.sort(key=lambda item: "test_demo_vllm" not in item.nodeid)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return make_checkpoints(Path(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def collective_engine(checkpoints: Checkpoints) -> Iterator[tuple[Any, Outputs]]:
    from refit_nccl.vllm import engine_args

    llm = start_engine(checkpoints.paths["B'"], engine_args())
    try:
        yield llm, generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def sparse_engine(checkpoints: Checkpoints) -> Iterator[tuple[Any, Outputs]]:
    from refit_zmq.vllm import engine_args

    llm = start_engine(checkpoints.paths["B"], engine_args())
    try:
        yield llm, generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def fresh(
    collective_engine: tuple[Any, Outputs], sparse_engine: tuple[Any, Outputs]
) -> dict[str, Outputs]:
    """What a freshly started engine generates on B and on B'."""
    return {"B": sparse_engine[1], "B'": collective_engine[1]}


@pytest.fixture(scope="session")
def ipc_engine(checkpoints: Checkpoints) -> Iterator[tuple[Any, Outputs]]:
    from refit_zmq.vllm import engine_args

    llm = start_engine(checkpoints.paths["A"], engine_args("ipc"))
    try:
        yield llm, generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
