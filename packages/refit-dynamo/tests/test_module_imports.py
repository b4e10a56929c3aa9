"""refit-dynamo's modules import each other one way: no cycle, counting imports made only
for type checking."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import refit_dynamo

PACKAGE = Path(refit_dynamo.__file__).parent


def _imports(path: Path) -> set[str]:
    """The ``refit_dynamo`` modules ``path`` imports anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("refit_dynamo."))
    return found


def test_no_import_cycle_between_modules() -> None:
    graph = {
        f"refit_dynamo.{path.stem}": _imports(path)
        for path in PACKAGE.glob("*.py")
        if path.stem != "__init__"
    }
    assert graph.get("refit_dynamo.channel")
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert order.index("refit_dynamo.transactions") < order.index("refit_dynamo.channel")
