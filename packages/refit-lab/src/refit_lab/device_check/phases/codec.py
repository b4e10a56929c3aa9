"""Phase ``codec``: the GPU delta encoder at 1 % changed on at least 8 GiB, through
``refit bench codec`` (refit-lab's bench runs the encoder against torch's own ``ne`` /
``nonzero`` and the host path, interleaved, and reports rates and their ratios).

Arguments: ``CODEC_BENCH_ARGS`` (default :data:`~refit_lab.device_check.plan.CODEC_BENCH_ARGS`). Its JSON is kept
whole in the result. Two ratios are taken from it: the GPU encoder's rate at 1 % against the
bench's own device-to-device copy of the same bytes (``gpu_encode_fraction_of_d2d_copy``),
and the sparse apply against a full reload: a reload moves every byte of the state from host
memory, so it is timed here as a pinned host-to-device copy of the same dense bytes right
after the bench, and the apply's dense-equivalent rate (``gpu_apply_gbps``) is divided by it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from refit_lab.device_check.plan import codec_bench_args
from refit_lab.device_check.timing import cuda_gbps

__all__ = ["bench_command", "read_bench", "run"]

_TIMEOUT_S = 90.0


def bench_command(json_path: Path) -> list[str]:
    """``refit bench codec`` with ``CODEC_BENCH_ARGS``, writing its JSON to ``json_path``."""
    args = shlex.split(codec_bench_args())
    return [
        sys.executable,
        "-m",
        "refit_core.cli",
        "bench",
        "codec",
        *args,
        "--json",
        str(json_path),
    ]


def read_bench(report: dict[str, Any]) -> dict[str, Any]:
    """The encode ratio, the apply rate and the dense bytes of a ``--device cuda`` codec report
    (:func:`refit_lab.bench.codec_gpu.measure_gpu`).

    Raises:
        KeyError: the report lacks them (the bench's format changed).
    """
    summary = report["summary"]
    return {
        "encode_vs_device_copy": float(summary["gpu_encode_fraction_of_d2d_copy"]),
        "encode_gbps": float(summary["gpu_encode_gbps"]),
        "apply_gbps": float(summary["gpu_apply_gbps"]),
        "reference_gbps": float(summary["gpu_encode_fraction_of_d2d_copy_reference_gbps"]),
        "dense_bytes": int(summary["state_bytes"]),
        "changed_fraction": float(summary["changed_fraction"]),
        "bitexact": bool(summary["bitexact"]),
    }


def _full_reload_gbps(nbytes: int) -> float:
    """A pinned host-to-device copy of ``nbytes`` (the least a full reload moves)."""
    host = torch.full((nbytes,), 1, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return cuda_gbps(lambda: device.copy_(host, non_blocking=True), nbytes, rounds=3)


def run() -> dict[str, Any]:
    """Run the bench, then the reload reference; ratios and the bench's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "codec.json"
        command = bench_command(path)
        try:
            finished = subprocess.run(
                command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "command": command, "error": f"ran past {_TIMEOUT_S:.0f} s"}
        if finished.returncode != 0 or not path.exists():
            pending = "unrecognized arguments" in finished.stderr
            return {
                "ok": False,
                "command": command,
                "returncode": finished.returncode,
                "error": (
                    "refit bench codec does not take these arguments yet (the GPU encoder's "
                    "bench options are not merged)"
                    if pending
                    else "refit bench codec failed"
                ),
                "tail": finished.stderr[-4000:],
            }
        report = json.loads(path.read_text())
    measured = read_bench(report)
    reload_gbps = _full_reload_gbps(measured["dense_bytes"])
    return {
        "ok": measured["bitexact"],
        "command": command,
        **measured,
        "full_reload_gbps": reload_gbps,
        "sparse_apply_vs_full_reload": measured["apply_gbps"] / reload_gbps,
        "bench": report,
    }
