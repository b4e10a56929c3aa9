"""Refit's reshard against Megatron-Core's own: ``dist_checkpointing`` saved at the source
layout and loaded at the destination layout, compared bitwise on every destination rank."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_model import CONFIG, natural_state
from megatron_workers import SEED
from refit_lab.ray_cluster import free_port
from refit_nccl.megatron.gpt import Parallelism


def _megatron_core_installed() -> bool:
    """Whether megatron-core can be imported, without importing it (~18 s)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` package at all
        return False


pytestmark = pytest.mark.skipif(
    not _megatron_core_installed(),
    reason="megatron-core (refit-nccl[megatron]) is not installed (an isolated package venv)",
)

TESTS = Path(__file__).parent
LAUNCH = "import sys, megatron_oracle; megatron_oracle.main(*sys.argv[1:])"
"""Run with ``-c``: Megatron's checkpoint writer spawns a multiprocessing manager, and a spawned
process re-imports a main script (torch, megatron-core: seconds per rank); ``-c`` has none."""
LAUNCH_S = 280.0
CASES: dict[str, dict[str, Any]] = {
    "tp2->1": {"src": {"tp": 2}, "dst": {"tp": 1}},
    "tp1->2": {"src": {"tp": 1}, "dst": {"tp": 2}},
    "tp4->2": {"src": {"tp": 4}, "dst": {"tp": 2}},
    "pp2->1": {"src": {"pp": 2}, "dst": {"pp": 1}},
}


def _dir_name(case: str) -> str:
    return case.replace("->", "_to_")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the oracle's and refit's ranks for every case once; the directory of their files."""
    out = tmp_path_factory.mktemp("megatron_oracle")
    cases = [
        {"name": _dir_name(name), "port": free_port(), "colocated": False, **case}
        for name, case in CASES.items()
    ]
    cases[0]["oracle_port"] = free_port()
    log = out / "launcher.log"
    with log.open("wb") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, json.dumps(cases), str(out)],
            cwd=TESTS,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = launcher.wait(LAUNCH_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # whatever is left of its session: ranks, Megatron's writer and manager processes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    if code != 0:
        pytest.fail(f"oracle launcher exited {code}:\n{log.read_text(errors='replace')[-8000:]}")
    return out


def _load(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
    return tensors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_reshard_is_bitwise_equal_to_megatron_dist_checkpointing(results: Path, case: str) -> None:
    folder = results / _dir_name(case)
    oracle_files = sorted(folder.glob("oracle*.pt"))
    refit_files = sorted(folder.glob("refit*.pt"))
    assert oracle_files
    assert [f.name[len("oracle") :] for f in oracle_files] == [
        f.name[len("refit") :] for f in refit_files
    ]
    for oracle_file, refit_file in zip(oracle_files, refit_files, strict=True):
        oracle, refit = _load(oracle_file), _load(refit_file)
        assert sorted(refit) == sorted(oracle), oracle_file.name
        for name, expected in oracle.items():
            got = refit[name]
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
            assert expected.count_nonzero() > 0, f"{name}: megatron loaded nothing"
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (
                f"{refit_file.name} {name} differs from megatron-core's"
            )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_reads_the_natural_weights_from_the_fused_ones(results: Path, case: str) -> None:
    """The test model's fused qkv and gate_up are laid out as Megatron's modules read them."""
    dst = Parallelism(**CASES[case]["dst"])
    natural = natural_state(CONFIG, SEED)
    splits = sorted((results / _dir_name(case)).glob("split*.pt"))
    assert len(splits) == dst.tp * dst.pp
    for split_file in splits:
        rank = int(split_file.stem[len("split") :])
        tp_rank, stage = rank % dst.tp, rank // dst.tp
        per_stage = CONFIG.layers // dst.pp
        split = _load(split_file)
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        expected = {
            f"{i}.{part}": natural[f"{i}.{key}"].chunk(dst.tp)[tp_rank]
            for i in layers
            for part, key in {
                "q": "q",
                "k": "k",
                "v": "v",
                "gate": "mlp.gate",
                "up": "mlp.up",
            }.items()
        }
        assert sorted(split) == sorted(expected), split_file.name
        for name, rows in expected.items():
            assert torch.equal(split[name].view(torch.int16), rows.view(torch.int16)), (
                f"{split_file.name} {name}: Megatron reads other rows"
            )
