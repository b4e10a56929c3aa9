"""Phase ``gpu-tests``: every ``gpu``-marked test of the repository under ``--require-gpu``.

Only the test files that mark tests ``gpu`` are collected (others may import what this
machine lacks). Tests that need more than this machine has (two GPUs, vLLM, Dynamo's runtime,
Ray) skip with their reason, which the result lists; a skip for want of a GPU would fail
instead.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

__all__ = ["gpu_test_files", "parse_junit", "run"]

_TIMEOUT_S = 140.0
"""Inside the phase's own limit, so the report is still written."""


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts, failures (with the first line of their message) and skips (with reasons)."""
    cases = ElementTree.parse(path).getroot().iter("testcase")
    passed: list[str] = []
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            lines = (problem.get("message") or "").splitlines()
            failed[name] = lines[0] if lines else ""
        elif skip is not None:
            skipped[name] = skip.get("message") or ""
        else:
            passed.append(name)
    return {
        "ok": not failed and bool(passed),
        "passed": len(passed),
        "failed": failed,
        "skipped": skipped,
        "passed_tests": passed,
    }


def gpu_test_files(root: Path) -> list[str]:
    """Test files under ``root``'s ``packages`` and ``tests`` that mark a test ``gpu``."""
    candidates = [
        *(root / "packages").glob("*/tests/**/test_*.py"),
        *(root / "tests").glob("**/test_*.py"),
    ]
    return sorted(
        str(path.relative_to(root))
        for path in candidates
        if "mark.gpu" in path.read_text(encoding="utf-8")
    )


def run() -> dict[str, Any]:
    """Run the gpu-marked tests from the repository root (the current directory)."""
    files = gpu_test_files(Path.cwd())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "gpu-tests.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "--require-gpu",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            f"--junitxml={report}",
            *files,
        ]
        try:
            finished = subprocess.run(
                command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout if isinstance(exc.stdout, str) else ""
            return {
                "ok": False,
                "error": f"pytest ran past {_TIMEOUT_S:.0f} s",
                "tail": output[-4000:],
            }
        if not report.exists():
            return {"ok": False, "returncode": finished.returncode, "tail": finished.stdout[-4000:]}
        result = parse_junit(report)
    sys.stdout.write(finished.stdout)
    return {**result, "returncode": finished.returncode, "files": files}
