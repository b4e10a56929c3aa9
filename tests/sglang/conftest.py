"""The SGLang tier: SGLang's own code (0.5.23, in .venv-sglang) is the receiving side.

Every test here is marked ``sglang``: it skips where SGLang is not importable and fails
instead under ``--require-sglang`` (scripts/test-sglang passes it). SGLang is imported only
inside the tests and the engine processes they start.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for path in (_HERE, _HERE.parents[1] / "packages" / "refit-sglang" / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(_HERE):
            item.add_marker(pytest.mark.sglang)
