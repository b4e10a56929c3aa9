"""`refit demo --engine vllm`: the demo's trainer refitting a real vLLM engine through the
factory, verified after every step (served version, the shadow's bits), then against a fresh
engine on the final weights (two engine start-ups)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refit_core.cli import main

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_demo_on_a_vllm_engine_verifies_every_sparse_refit(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "demo.json"
    argv = ["demo", "--engine", "vllm", "--transport", "zmq_sparse", "--workers", "1"]
    assert main([*argv, "--steps", "2", "--timeout", "120", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["transport"], report["workers"]) == ("zmq_sparse", 1)
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["verified"] and step["outcome"] == "committed", step
        assert 0 < step["changed_fraction"] < 0.5
        assert 0 < step["wire_bytes"] < step["dense_bytes"]
    assert [s["detail"] for s in steps] == [
        "",
        "tokens equal a fresh vLLM engine's on the final weights",
    ], "the sparse receiver exposes its bits; the fresh engine checks the tokens"
