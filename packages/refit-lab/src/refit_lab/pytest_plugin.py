"""pytest plugin: the ``gpu``, ``netns``, ``engine`` and ``sglang`` markers skip or fail by need.

A marked test skips with a reason when its need is absent, and fails instead when the run
passes ``--require-gpu`` / ``--require-netns`` / ``--require-engine`` / ``--require-sglang``,
so a CI job cannot pass
by skipping. Loaded by the repository's root ``conftest.py``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable

import pytest

__all__ = ["NEEDS", "engine_available", "gpu_available", "netns_available", "sglang_available"]


def gpu_available() -> str | None:
    """None when a CUDA GPU is usable, else the reason it is not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA GPU"


def netns_available() -> str | None:
    """None when root network namespaces can be made, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is missing"
    return None


def engine_available() -> str | None:
    """None when a real vLLM engine is importable, else the reason it is not."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment (run scripts/test-engine)"
    return None


def sglang_available() -> str | None:
    """None when SGLang's own modules are importable, else the reason they are not."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed in this environment (run scripts/test-sglang)"
    return None


_MISSING = pytest.StashKey[list[str]]()

NEEDS: dict[str, Callable[[], str | None]] = {
    "gpu": gpu_available,
    "netns": netns_available,
    "engine": engine_available,
    "sglang": sglang_available,
}


_DESCRIPTIONS = {
    "gpu": "needs a CUDA GPU",
    "netns": "needs root network namespaces",
    "engine": "needs a real inference engine (vLLM)",
    "sglang": "needs SGLang's own code (sglang importable)",
}


def pytest_configure(config: pytest.Config) -> None:
    for need, text in _DESCRIPTIONS.items():
        config.addinivalue_line(
            "markers", f"{need}: {text} (skips without; fails under --require-{need})"
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refit")
    for need in NEEDS:
        group.addoption(
            f"--require-{need}",
            action="store_true",
            default=False,
            help=f"fail, instead of skipping, tests marked {need!r} whose need is absent",
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons: dict[str, str | None] = {}
    for item in items:
        for need, probe in NEEDS.items():
            if item.get_closest_marker(need) is None:
                continue
            if need not in reasons:
                reasons[need] = probe()
            reason = reasons[need]
            if reason is None:
                continue
            if config.getoption(f"--require-{need}"):
                item.stash[_MISSING] = [*item.stash.get(_MISSING, []), f"{need}: {reason}"]
            else:
                item.add_marker(pytest.mark.skip(reason=f"{need}: {reason}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    missing = item.stash.get(_MISSING, [])
    if missing:
        pytest.fail(f"required but unavailable: {'; '.join(missing)}", pytrace=False)
