"""The ``refit`` command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from refit_core import __version__
from refit_core.cli import main
from refit_core.known_rows import KNOWN_ROWS


def test_backends_lists_every_known_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for row in KNOWN_ROWS:
        line = next(x for x in lines if x.split()[:3] == row.key.split("."))
        assert line.endswith("installed") or line.endswith(row.install_hint)
    if importlib.util.find_spec("refit_zmq") is not None:
        note = "vllm.non-colocated.zmq_sparse: previous version, bit for bit"
        assert any(x.strip().startswith(note) for x in lines)


def test_backends_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json"]) == 0
    records = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(records) >= {row.key for row in KNOWN_ROWS}
    for row in KNOWN_ROWS:
        record = records[row.key]
        installed = importlib.util.find_spec(row.package.replace("-", "_")) is not None
        assert record["status"] == ("installed" if installed else "missing")
        assert record["version"] == (__version__ if installed else None)
        assert record["install_hint"] == (None if installed else row.install_hint)
        staging = {"vllm.non-colocated.collective", "vllm.non-colocated.zmq_sparse"}
        assert record["can_stage"] is ((row.key in staging) if installed else None), row.key
        kinds = ["lora"] if row.transport == "lora" else ["dense"]
        assert record["model_kinds"] == (kinds if installed else None), row.key
    collective = records["vllm.non-colocated.collective"]
    if collective["status"] == "installed":
        assert "closed until a complete refit" in collective["on_failure"]


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
