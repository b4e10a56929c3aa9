"""Fixtures that install backend packages into this process the way pip would: a
``*.dist-info`` with entry points on ``sys.path``, found by ``importlib.metadata``."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

TOY = Path(__file__).parent / "toy_backend"

collect_ignore = ["bare"]
"""``bare/`` needs a venv holding refit-core alone: only scripts/test-isolated's bare step
runs it."""

Install = Callable[[str, str, Mapping[str, str], Mapping[str, str]], None]


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """``install(name, version, entry_points, modules)``: a distribution registering
    ``entry_points`` (name -> value) in ``refit.backends``, with ``modules`` (name -> code)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(
        name: str, version: str, entry_points: Mapping[str, str], modules: Mapping[str, str]
    ) -> None:
        info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[refit.backends]\n{lines}")
        for module, code in modules.items():
            (tmp_path / f"{module}.py").write_text(code)

    yield make
    for name, module in list(sys.modules.items()):
        origin = str(getattr(module, "__file__", None) or "")
        if origin.startswith((str(tmp_path), str(TOY))):
            del sys.modules[name]


@pytest.fixture
def toy(install: Install, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy third-party backend (``tests/toy_backend``), installed in this process."""
    project = tomllib.loads((TOY / "pyproject.toml").read_text())["project"]
    monkeypatch.syspath_prepend(str(TOY / "src"))
    install(project["name"], project["version"], project["entry-points"]["refit.backends"], {})
