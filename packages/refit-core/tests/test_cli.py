"""The ``refit`` command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from refit_core import __version__
from refit_core.cli import main
from refit_core.registry import KNOWN_ROWS


def test_backends_lists_every_row_with_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for row in KNOWN_ROWS:
        assert row.transport in out and row.install_hint in out
    assert "vllm.non-colocated.zmq_sparse: previous version, bit for bit" in out


def test_backends_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["key"] for r in records} == {row.key for row in KNOWN_ROWS}
    on_failure = {r["key"]: r["on_failure"] for r in records}
    assert "closed until a complete refit" in on_failure["vllm.non-colocated.collective"]
    for record in records:
        installed = importlib.util.find_spec(record["package"].replace("-", "_")) is not None
        assert record["installed_version"] == (__version__ if installed else None)


def test_console_script_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "refit_core.cli", "--version"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert proc.stdout.strip() == f"refit-core {__version__}"


def test_unknown_subcommand_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
