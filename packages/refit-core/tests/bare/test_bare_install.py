"""refit-core installed alone (no extra, no other refit package, no torch, numpy or vLLM):
every public module that needs no extra imports, the factory and ``refit backends`` run as far
as they go without a backend, and each module that needs an extra fails naming it.

Only scripts/test-isolated's bare step runs this module (``-c tests/bare/pytest.ini``); the
checkout's other runs ignore the folder (``tests/conftest.py``), and run in any other
environment every test here fails on the environment check.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tomllib
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bare_install

PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"

ABSENT = ("torch", "numpy", "vllm", "xxhash", "zmq", "ray")
"""Third-party packages a bare refit-core must not need (none of them may be installed)."""

NEEDS_EXTRA = {
    "refit_core.vllm.loading": "vllm",
    "refit_core.vllm.runtime_check": "vllm",
    "refit_core.vllm.write_map": "vllm",
}
"""The public modules that import an extra's packages at load, and that extra."""


def public_modules() -> list[str]:
    return list(tomllib.loads(PYPROJECT.read_text())["tool"]["refit"]["public-modules"])


@pytest.fixture(autouse=True, scope="module")
def bare_environment() -> None:
    """Fails every test here unless refit-core is the only refit package and none of
    :data:`ABSENT` is installed (elsewhere the checks below would prove nothing)."""
    present = [name for name in ABSENT if find_spec(name) is not None]
    refit = sorted(
        name
        for dist in metadata.distributions()
        if (name := dist.metadata["Name"]).startswith("refit")
    )
    if present or refit != ["refit-core"]:
        pytest.fail(
            f"not a bare refit-core venv: installed {present} and refit packages {refit}; "
            "run scripts/test-isolated refit-core",
            pytrace=False,
        )


def test_every_module_said_to_need_an_extra_is_public() -> None:
    assert set(NEEDS_EXTRA) <= set(public_modules())


@pytest.mark.parametrize("module", public_modules())
def test_public_module_imports_or_names_its_extra(module: str) -> None:
    extra = NEEDS_EXTRA.get(module)
    if extra is None:
        imported = importlib.import_module(module)
        assert [n for n in imported.__all__ if not hasattr(imported, n)] == []
        return
    hint = f'pip install "refit-core[{extra}]"'
    with pytest.raises(ImportError) as raised:
        importlib.import_module(module)
    assert hint in str(raised.value)
    assert raised.value.name in ABSENT


def factory_error(**kwargs: Any) -> BaseException:
    from refit_core import create_weight_synchronizer

    with pytest.raises(Exception) as raised:
        create_weight_synchronizer(None, None, **kwargs)
    return raised.value


def test_factory_rejects_bad_input_before_looking_for_a_backend() -> None:
    from refit_core import InvalidTimeoutError

    unknown = factory_error(generation_backend="nope", colocated=True)
    assert type(unknown) is ValueError
    assert "vllm" in str(unknown)
    bad_timeout = factory_error(generation_backend="vllm", colocated=True, refit_timeout_s=-1)
    assert type(bad_timeout) is InvalidTimeoutError  # the one rule's error (a ValueError too)
    unsupported = factory_error(generation_backend="dynamo", colocated=True)
    assert type(unsupported) is NotImplementedError


@pytest.mark.parametrize(
    ("backend", "colocated", "extra"),
    [("vllm", True, "vllm"), ("vllm", False, "vllm"), ("sglang", True, "sglang")],
)
def test_factory_names_the_extra_of_a_known_backend(
    backend: str, colocated: bool, extra: str
) -> None:
    from refit_core import BackendNotInstalledError

    error = factory_error(generation_backend=backend, colocated=colocated)
    assert isinstance(error, BackendNotInstalledError)
    assert error.install_hint == f'pip install "refit-core[{extra}]"'


def test_refit_backends_lists_every_known_row_as_missing() -> None:
    refit = Path(sys.executable).parent / "refit"
    listing = subprocess.run(
        [str(refit), "backends", "--json"], capture_output=True, text=True, timeout=60, check=True
    )
    rows = json.loads(listing.stdout)
    assert {row["backend"] for row in rows} == {"vllm", "sglang", "megatron", "dynamo"}
    assert {row["status"] for row in rows} == {"missing"}
    assert all(row["install_hint"].startswith('pip install "refit-core[') for row in rows)
