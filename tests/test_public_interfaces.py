"""No package reaches into another package's internals.

Each package lists its public modules in its pyproject (``[tool.refit] public-modules``): its
top-level package, its published interface modules (``refit_core.backend``,
``refit_nccl.backend``) and the documented subpackages users import (``refit_zmq.vllm``).
A public module's names are those in its ``__all__``. Every other module is internal to its
package. This test walks every import (``import``, ``from ... import``, and literal
``importlib.import_module`` / ``pytest.importorskip`` calls) in every package's sources and
tests and in the cross-package ``tests/``, and fails on one that reaches another package's
internals.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
DYNAMIC_IMPORTERS = frozenset({"import_module", "importorskip"})


@dataclass(frozen=True)
class Import:
    """One import: where it is, which module it names, and the name taken from it (if any)."""

    path: Path
    line: int
    module: str
    name: str | None

    def __str__(self) -> str:
        taken = f"import {self.name}" if self.name else "import"
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.line}: {self.module} {taken}"


def public_modules(package: Path) -> tuple[str, ...]:
    data = tomllib.loads((package / "pyproject.toml").read_text())
    modules: list[str] = data["tool"]["refit"]["public-modules"]
    return tuple(modules)


@cache
def owners() -> dict[str, Path]:
    """Top-level import name -> the package directory that ships it."""
    return {
        module.name: package
        for package in PACKAGES
        for module in (package / "src").iterdir()
        if (module / "__init__.py").exists()
    }


def module_file(module: str) -> Path | None:
    package = owners().get(module.split(".")[0])
    if package is None:
        return None
    base = package / "src" / Path(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


@cache
def exported(module: str) -> frozenset[str] | None:
    """The names in ``module``'s literal ``__all__`` (None: the module or its ``__all__`` is
    missing)."""
    path = module_file(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return frozenset(ast.literal_eval(node.value))
    return None


def imports(path: Path) -> Iterator[Import]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield Import(path, node.lineno, node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name, None)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if called in DYNAMIC_IMPORTERS and literal:
                yield Import(path, node.lineno, str(first.value), None)


def violation(found: Import, importer: Path | None) -> str | None:
    """Why ``found`` reaches another package's internals, or None."""
    owner = owners().get(found.module.split(".")[0])
    if owner is None or owner == importer:
        return None
    public = public_modules(owner)
    if found.module not in public:
        return f"{found}: {found.module} is internal to {owner.name}"
    if found.name is None or found.name in (exported(found.module) or ()):
        return None
    if f"{found.module}.{found.name}" in public:
        return None
    return f"{found}: {found.name} is not in {found.module}.__all__"


def sources() -> Iterator[tuple[Path, Path | None]]:
    """Every Python file with the package it belongs to (None: the cross-package tests)."""
    for package in PACKAGES:
        for folder in ("src", "tests"):
            for path in sorted((package / folder).rglob("*.py")):
                yield path, package
    for path in sorted((ROOT / "tests").rglob("*.py")):
        yield path, None


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_public_modules_exist_and_declare_their_names(package: Path) -> None:
    modules = public_modules(package)
    top = package.name.replace("-", "_")
    assert top in modules
    for module in modules:
        assert module.split(".")[0] == top
        assert exported(module), f"{module} is missing or has no literal, non-empty __all__"


def test_no_package_imports_another_packages_internals() -> None:
    problems = [
        problem
        for path, package in sources()
        for found in imports(path)
        if (problem := violation(found, package)) is not None
    ]
    assert not problems, f"{len(problems)} imports of internals:\n" + "\n".join(problems)


def test_the_check_sees_an_internal_import(tmp_path: Path) -> None:
    """The walker is not blind: an import of an internal module is caught, a public one not."""
    module = tmp_path / "probe.py"
    module.write_text(
        "from refit_core import create_weight_synchronizer\n"
        "from refit_core.registry import find_row\n"
        "import refit_nccl.group.abortable\n"
        "importlib.import_module('refit_zmq.relay.ledger')\n"
    )
    found = [v for i in imports(module) if (v := violation(i, None)) is not None]
    assert len(found) == 3
