"""`refit demo`: settings, report, the trainer's own forward, and whole runs through the CLI
(a local Ray cluster, reference-engine workers, real refits and one injected fault)."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from refit_core.cli import main
from refit_lab.demo.report import DemoReport, RefitRecord
from refit_lab.demo.settings import DemoSettings
from refit_lab.demo.training import DemoTrainer, TrainingConfig
from refit_lab.reference_engine import ReferenceEngine
from refit_lab.serving_load import ServingCounts

TINY = DemoSettings(model="tiny").model_config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"transport": "carrier-pigeon"}, "transport must be one of"),
        ({"model": "huge"}, "model must be one of"),
        ({"workers": 0}, ">= 1"),
        ({"fault": "meteor"}, "fault must be one of"),
        ({"transport": "collective", "fault": "corrupt"}, "applies to"),
        ({"workers": 1, "fault": "kill-worker"}, "at least 2 workers"),
        ({"steps": 3, "fault": "corrupt", "fault_step": 4}, "fault_step must be in"),
        ({"timeout_s": 0.0}, "must be > 0"),
        ({"inflight": True}, "--transport collective can stage"),
        ({"inflight": True, "transport": "collective", "engine": "vllm"}, "can stage"),
        ({"inflight": True, "transport": "collective", "fault": "kill-worker"}, "without"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoSettings(**kwargs)  # type: ignore[arg-type]


def test_the_cli_refuses_a_fault_its_transport_cannot_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--transport", "collective", "--fault", "kill-relay"]) == 2
    assert "applies to" in capsys.readouterr().err


def test_fault_defaults_to_the_middle_step() -> None:
    assert DemoSettings(steps=5, fault="corrupt").faulted_step == 3
    assert DemoSettings(steps=5).faulted_step is None


def test_one_unverified_refit_fails_the_report() -> None:
    good = RefitRecord(1, "committed", 0.01, 10, 100, 0.5, True, 7.0)
    bad = RefitRecord(2, "committed", 0.01, 10, 100, 0.5, False, 7.0, detail="workers [1] differ")
    report = DemoReport("zmq_sparse", 2, [good])
    assert report.ok
    report.records.append(bad)
    assert not report.ok
    assert "NO" in report.table() and "workers [1] differ" in report.table()
    assert good.effective_gbps == pytest.approx(100 / 0.5 / 1e9)


def test_a_lost_request_fails_the_report_and_pauses_show_beside_the_refit_time() -> None:
    staged = RefitRecord(1, "committed", 0.01, 10, 100, 0.5, True, 7.0, pause_s=0.0123)
    report = DemoReport("collective", 2, [staged], ServingCounts(submitted=9, completed=9))
    assert report.ok
    header, _, row, *footer = report.table().splitlines()
    assert re.search(r"refit s +pause ms", header) and row.split()[6:8] == ["0.500", "12.3"]
    assert footer == ["serving: 9 requests through the run, 9 complete, 0 lost"]
    assert report.to_json()["steps"][0]["pause_ms"] == pytest.approx(12.3)
    report.serving = ServingCounts(submitted=9, completed=8, errors=["EngineClosedError"])
    assert not report.ok
    assert report.to_json()["serving"]["lost"] == 1
    assert "pause ms" not in DemoReport("zmq_sparse", 2, [replace(staged, pause_s=None)]).table()


def test_training_moves_a_small_fraction_of_bf16_elements() -> None:
    trainer = DemoTrainer(TINY, TrainingConfig(lr=2e-6))
    before = trainer.engine_state()
    loss = trainer.train_step()
    after = trainer.engine_state()
    changed = sum(
        int((before[n].view(torch.int16) != t.view(torch.int16)).sum()) for n, t in after.items()
    )
    assert loss > 0
    assert 0 < changed < 0.05 * trainer.num_elements


def test_the_trainers_greedy_tokens_are_an_engines_on_the_same_bits() -> None:
    trainer = DemoTrainer(TINY, TrainingConfig(lr=1e-3))
    trainer.train_step()
    engine = ReferenceEngine(TINY)
    engine.load_weights(trainer.engine_state().items())
    prompts = trainer.prompts(3, 6)
    assert trainer.greedy(prompts, 6) == engine.generate(prompts, 6).tokens
    stale = ReferenceEngine(TINY, seed=5)
    assert trainer.greedy(prompts, 6) != stale.generate(prompts, 6).tokens


def _run(tmp_path: Path, *args: str) -> dict[str, object]:
    pytest.importorskip("ray")
    out = tmp_path / "demo.json"
    argv = ["demo", "--model", "tiny", "--workers", "3", "--steps", "3", "--timeout", "10"]
    assert main([*argv, *args, "--json", str(out)]) == 0
    report: dict[str, object] = json.loads(out.read_text())
    return report


@pytest.mark.slow
def test_demo_rolls_back_a_corrupted_refit_then_commits(tmp_path: Path) -> None:
    report = _run(tmp_path, "--fault", "corrupt", "--fault-step", "2")
    assert report["transport"] == "zmq_sparse" and report["workers"] == 3
    steps = report["steps"]
    assert isinstance(steps, list)
    assert [(s["step"], s["outcome"]) for s in steps] == [
        (1, "committed"),
        (2, "rolled back"),
        (2, "committed"),
        (3, "committed"),
    ]
    assert all(s["verified"] for s in steps)
    assert "ChecksumMismatchError" in steps[1]["detail"]
    sparse = steps[3]
    assert 0 < sparse["changed_fraction"] < 0.05
    assert sparse["wire_bytes"] < sparse["dense_bytes"] / 4


@pytest.mark.slow
def test_demo_survives_a_killed_worker_on_the_collective(tmp_path: Path) -> None:
    report = _run(tmp_path, "--transport", "collective", "--fault", "kill-worker")
    steps = report["steps"]
    assert isinstance(steps, list)
    assert [s["outcome"] for s in steps] == ["committed", "aborted", "committed", "committed"]
    assert all(s["verified"] for s in steps)


@pytest.mark.slow
def test_demo_inflight_keeps_serving_through_staged_refits(tmp_path: Path) -> None:
    report = _run(tmp_path, "--inflight")
    assert report["transport"] == "collective"
    steps = report["steps"]
    assert isinstance(steps, list)
    assert [(s["outcome"], s["verified"]) for s in steps] == [("committed", True)] * 3
    assert all(0 < s["pause_ms"] < 1e3 * s["refit_s"] for s in steps)
    serving = report["serving"]
    assert isinstance(serving, dict)
    assert serving["lost"] == 0 and serving["completed"] == serving["submitted"] >= 6


def test_engine_vllm_without_vllm_exits_2_saying_how_to_run_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: the engine tier runs the demo on it")
    assert main(["demo", "--engine", "vllm", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm needs vLLM" in err and "scripts/demo-vllm" in err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engine": "tgi"}, "engine must be one of"),
        ({"engine": "vllm", "model": "tiny"}, "head_dim 16"),
        ({"engine": "vllm", "fault": "kill-worker"}, "needs the reference engine"),
    ],
)
def test_bad_vllm_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_demo_refits_dynamo_workers_verified(tmp_path: Path) -> None:
    pytest.importorskip("dynamo.runtime", reason="ai-dynamo-runtime (dev group) is not installed")
    out = tmp_path / "demo.json"
    argv = ["demo", "--transport", "dynamo", "--model", "tiny", "--workers", "2", "--steps", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["transport"] == "dynamo" and report["workers"] == 2
    steps = report["steps"]
    assert [(s["step"], s["outcome"], s["verified"]) for s in steps] == [
        (1, "committed", True),
        (2, "committed", True),
    ]
    assert all(s["detail"] == "" and 0 < s["changed_fraction"] < 0.05 for s in steps)
    assert all(s["wire_bytes"] > 0 and s["dense_bytes"] > 0 for s in steps)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"transport": "dynamo", "engine": "vllm", "model": "small"}, "reference engines"),
        ({"transport": "dynamo", "fault": "kill-worker"}, "applies to"),
    ],
)
def test_bad_dynamo_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DemoSettings(**kwargs)  # type: ignore[arg-type]
