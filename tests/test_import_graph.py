"""No package's modules import each other in a circle (``scripts/import-graph``).

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too: a circle
there is still two modules that cannot be understood (or moved) one without the other.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "scripts" / "import-graph"
_LOADER = SourceFileLoader("import_graph", str(SCRIPT))
import_graph = importlib.util.module_from_spec(
    importlib.util.spec_from_loader("import_graph", _LOADER)
)
_LOADER.exec_module(import_graph)
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/src/*/__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycle(package: Path) -> None:
    lines, acyclic = import_graph.report(package, quiet=False)
    assert acyclic, "\n".join(lines)


def test_the_script_prints_the_graph_and_fails_on_a_cycle(tmp_path: Path) -> None:
    """The check is not blind: a circle closed only under TYPE_CHECKING, or through
    ``from package import module``, fails the script; the same package without it passes."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "leaf.py").write_text("X = 1\n")
    (package / "sub" / "a.py").write_text("from pkg.leaf import X\nfrom pkg.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sub.a import Y\n"
    )
    run = [sys.executable, str(SCRIPT), str(package)]
    failed = subprocess.run(run, capture_output=True, text=True, check=False)
    assert failed.returncode == 1
    assert "CYCLE in pkg: pkg.sub.a <-> pkg.sub.b" in failed.stdout
    assert "pkg.sub.b imports pkg.sub.a" in failed.stdout

    (package / "sub" / "b.py").write_text("from pkg.leaf import X\n")
    passed = subprocess.run(run, capture_output=True, text=True, check=False)
    assert passed.returncode == 0, passed.stdout
    assert "   0  leaf  ->  -" in passed.stdout
    assert "   1  sub.b  ->  leaf" in passed.stdout
    assert "   2  sub.a  ->  leaf, sub.b" in passed.stdout
    assert "no cycle in pkg" in passed.stdout
