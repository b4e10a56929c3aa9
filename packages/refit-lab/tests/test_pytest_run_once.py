"""The run-once plugin: a test recorded as passed by one pytest run is not run by the next,
and nothing else is left out (real pytest runs in subprocesses, plain and under xdist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SUITE = """
import pytest

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")

def test_passes(): pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n): assert n == 1

def test_fails(): assert False

def test_skips(): pytest.skip("no need here")

@pytest.mark.xfail(reason="known")
def test_xfails(): assert False

def test_teardown_fails(broken_teardown): pass
"""


def _pytest(folder: Path, *args: str) -> str:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "refit_lab.pytest_run_once",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "-rA",
            *args,
            str(folder / "test_suite.py"),
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # the suite holds failing tests
    return run.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_only_passed_tests_are_recorded_and_only_they_are_skipped(
    tmp_path: Path, workers: list[str]
) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    passed = tmp_path / "passed"
    _pytest(tmp_path, *workers, "--record-passed", str(passed / "first"))
    recorded = sorted((passed / "first").read_text().splitlines())
    assert recorded == ["test_suite.py::test_param[1]", "test_suite.py::test_passes"]

    second = _pytest(tmp_path, *workers, "--skip-passed", str(passed))
    assert "run once: 2 tests passed in" in second
    if not workers:  # under xdist the workers deselect, the controller's summary counts none
        assert "2 deselected" in second
    ran = {
        line.split(" ", 1)[1].split(" - ")[0]
        for line in second.splitlines()
        if line.startswith(("PASSED ", "FAILED ", "SKIPPED ", "XFAIL ", "ERROR "))
    }
    assert "test_suite.py::test_passes" not in ran and "test_suite.py::test_param[1]" not in ran
    assert {
        "test_suite.py::test_param[2]",
        "test_suite.py::test_fails",
        "test_suite.py::test_teardown_fails",
    } <= ran


def test_a_missing_folder_skips_nothing(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    out = _pytest(tmp_path, "--skip-passed", str(tmp_path / "absent"))
    assert "deselected" not in out and "2 failed, 3 passed, 1 skipped, 1 xfailed, 1 error" in out
