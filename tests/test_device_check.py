"""``scripts/device-check --plan`` on CPU: the wheel folder, the phases and their commands; the
verdicts and the summary the GPU run writes, from synthetic phase results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from refit_core.cli import build_parser
from refit_lab.bench.codec_gpu import measure_gpu
from refit_lab.bench.harness import BenchContext
from refit_lab.device_check.phases.codec import bench_command, read_bench
from refit_lab.device_check.phases.gpu_tests import gpu_test_files, parse_junit
from refit_lab.device_check.plan import (
    PHASES,
    REFIT_PACKAGES,
    THIRD_PARTY,
    check_wheels,
    select_phases,
)
from refit_lab.device_check.report import PhaseOutcome, evaluate, markdown

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"
GOOD = [
    *(f"{p.replace('-', '_')}-{VERSION}-py3-none-any.whl" for p in REFIT_PACKAGES),
    "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
    "zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
]


def _folder(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"PK")
    return folder


def _plan(wheels: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts" / "device-check"), "--plan"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **os.environ,
            "DEVICE_CHECK_WHEELS": str(wheels),
            "DEVICE_CHECK_PYTHON": sys.executable,
            **env,
        },
    )


def test_the_plan_lists_every_phase_and_its_commands(tmp_path: Path) -> None:
    shown = _plan(_folder(tmp_path, GOOD))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "problem" not in shown.stdout
    assert "pip install -q --no-index --no-deps --no-compile --target" in shown.stdout
    for phase in PHASES:
        assert f"[{phase.name}, {phase.timeout_s:.0f} s]" in shown.stdout
        assert f"refit_lab.device_check phase {phase.name} --out" in shown.stdout
    assert "bench codec --device cuda" in shown.stdout
    assert "pytest -m gpu --require-gpu" in shown.stdout
    assert "535 s" in shown.stdout


def test_phases_are_chosen_by_name(tmp_path: Path) -> None:
    shown = _plan(_folder(tmp_path, GOOD), PHASES="collective,ipc")
    assert shown.returncode == 0
    listed = [line.split(",")[0].strip(" [") for line in shown.stdout.splitlines() if "] " in line]
    assert listed == ["ipc", "collective"]  # the check's order, not the caller's
    refused = _plan(_folder(tmp_path / "other", GOOD), PHASES="ipc,warp")
    assert refused.returncode == 2 and "unknown phases ['warp']" in refused.stdout
    assert select_phases("") == PHASES


def test_a_missing_duplicated_or_foreign_wheel_is_a_problem(tmp_path: Path) -> None:
    names = [n for n in GOOD if not n.startswith("zstandard")]
    names += [
        "pyzmq-26.0.0-cp312-abi3-manylinux_2_28_x86_64.whl",
        "refit_lab-0.0.9-py3-none-any.whl",
        "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl",
    ]
    problems = check_wheels(_folder(tmp_path, names), VERSION)
    assert "no wheel of zstandard 0.25.0" in problems
    assert any(p.startswith("pyzmq: more than one wheel") for p in problems)
    assert any(p.startswith("refit_lab: more than one wheel") for p in problems)
    assert "unexpected wheel of numpy (it would be installed too)" in problems
    shown = _plan(_folder(tmp_path / "bad", names))
    assert shown.returncode == 1 and "problem: no wheel of zstandard" in shown.stdout
    arm = [n.replace("x86_64", "aarch64") if n.startswith("zstandard") else n for n in GOOD]
    assert check_wheels(_folder(tmp_path / "arm", arm), VERSION) == [
        f"{arm[-1]}: not for x86-64 Linux"
    ]
    assert check_wheels(tmp_path / "absent", VERSION)[0].endswith(
        "run scripts/device-check --prepare"
    )


def test_third_party_pins_are_the_lock_files() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    locked = {p["name"]: p["version"] for p in lock["package"]}
    assert {name: locked[name] for name in THIRD_PARTY} == THIRD_PARTY


def test_the_phases_fit_one_device_command() -> None:
    assert sum(p.timeout_s for p in PHASES) <= 540  # 600 s per command, with room to install


def test_verdicts_and_the_benchmarks_section() -> None:
    outcomes = {
        "references": PhaseOutcome("references", "passed", 20.0, {"device_copy_gbps": 2100.0}),
        "ipc": PhaseOutcome(
            "ipc", "passed", 30.0, {"ipc_vs_device_copy": 0.61, "device_copy_gbps": 2080.0}
        ),
        "codec": PhaseOutcome(
            "codec",
            "passed",
            60.0,
            {
                "encode_vs_device_copy": 0.42,
                "reference_gbps": 2000.0,
                "sparse_apply_vs_full_reload": 14.0,
                "full_reload_gbps": 50.0,
            },
        ),
    }
    verdicts = {v["name"]: v for v in evaluate(outcomes)}
    assert verdicts["ipc_vs_device_copy"]["pass"] is True
    assert verdicts["gpu_encode_vs_device_copy"]["pass"] is False
    assert verdicts["sparse_apply_vs_full_reload"]["pass"] is True
    assert verdicts["sparse_apply_vs_full_reload"]["reference_gbps"] == 50.0
    missing = {v["name"]: v for v in evaluate({})}
    assert missing["ipc_vs_device_copy"]["pass"] is None
    assert missing["ipc_vs_device_copy"]["why_not_measured"] == "phase not run"
    summary = {
        "command": "scripts/device-check out",
        "commit": "abc1234",
        "started": "2026-12-01T00:00:00+00:00",
        "phases": {
            n: {"status": o.status, "wall_s": o.wall_s, "result": dict(o.result)}
            for n, o in outcomes.items()
        },
        "targets": list(verdicts.values()),
    }
    section = markdown(summary)
    assert "| device_copy | 2.1e+03 |" in section
    assert "| 0.61 | >= 0.5 | 2.08e+03 | pass |" in section
    assert "| 0.42 | >= 0.5 | 2e+03 | FAIL |" in section
    assert "`scripts/device-check out` (refit abc1234)" in section


def test_gpu_test_results_are_read_from_pytests_junit_report(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n\n"
        "def test_needs_two():\n    pytest.skip('NCCL group tests need two CUDA GPUs')\n"
    )
    report = tmp_path / "report.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "-c",
            os.devnull,
            str(tmp_path / "test_sample.py"),
        ],
        capture_output=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    result = parse_junit(report)
    assert result["passed"] == 1 and not result["ok"]
    assert list(result["failed"]) == ["test_sample::test_bad"]
    assert "one is not two" in result["failed"]["test_sample::test_bad"]
    assert list(result["skipped"].values()) == ["NCCL group tests need two CUDA GPUs"]


def test_every_gpu_marked_test_file_is_collected() -> None:
    files = gpu_test_files(ROOT)
    assert "packages/refit-nccl/tests/test_gpu.py" in files
    assert "tests/engine/test_vllm_nccl_gpu.py" in files
    assert all("mark.gpu" in (ROOT / f).read_text() for f in files)
    assert "packages/refit-nccl/tests/test_group.py" not in files


@pytest.mark.parametrize("phase", [p.name for p in PHASES])
def test_every_phase_has_a_module_with_run(phase: str) -> None:
    import importlib

    from refit_lab.device_check.phases import PHASE_MODULES

    assert callable(importlib.import_module(PHASE_MODULES[phase]).run)


def test_the_codec_phase_command_is_one_refit_accepts() -> None:
    """The phase's ``refit bench codec`` arguments parse with refit's own command line."""
    command = bench_command(Path("codec.json"))
    args = build_parser().parse_args(command[command.index("bench") :])
    assert (args.name, args.device, args.size_bytes) == ("codec", "cuda", 8 << 30)


def test_the_codec_phase_reads_what_the_gpu_bench_writes() -> None:
    """The GPU bench's report (its logic run on CPU tensors) gives every field the phase uses."""
    ctx = BenchContext(quick=True, threads=2, size_bytes=1 << 20)
    report = json.loads(json.dumps(measure_gpu(ctx, repeats=1, device="cpu").to_json()))
    measured = read_bench(report)
    summary = report["summary"]
    assert measured["encode_vs_device_copy"] == summary["gpu_encode_fraction_of_d2d_copy"]
    assert measured["apply_gbps"] == summary["gpu_apply_gbps"] > 0
    assert measured["dense_bytes"] == summary["state_bytes"] >= 1 << 20
    assert measured["bitexact"] is True
