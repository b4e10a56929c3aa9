"""The ``gpu`` / ``netns`` / ``engine`` markers skip without their need and fail under ``--require-*``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from refit_lab.pytest_plugin import NEEDS

MARKED = """
import pytest

pytest_plugins = ["refit_lab.pytest_plugin"]

@pytest.mark.{need}
def test_marked():
    pass

def test_unmarked():
    pass
"""


def run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=directory, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("need", sorted(NEEDS))
def test_missing_need_skips_and_required_need_fails(tmp_path: Path, need: str) -> None:
    if NEEDS[need]() is None:
        pytest.skip(f"{need} is available here, so neither path can be shown")
    (tmp_path / "conftest.py").write_text(MARKED.format(need=need).split("@pytest")[0])
    (tmp_path / "test_marked.py").write_text(
        MARKED.format(need=need).replace('pytest_plugins = ["refit_lab.pytest_plugin"]', "")
    )
    skipped = run_pytest(tmp_path)
    assert skipped.returncode == 0, skipped.stdout
    assert "1 passed, 1 skipped" in skipped.stdout
    assert f"{need}: " in skipped.stdout
    required = run_pytest(tmp_path, f"--require-{need}")
    assert required.returncode == 1, required.stdout
    assert "required but unavailable" in required.stdout
    assert "1 passed, 1 error" in required.stdout
    assert "Unknown pytest.mark" not in skipped.stdout + required.stdout
