"""Phase ``environment``: what the numbers were measured on, and whether refit imports."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
import subprocess
from typing import Any

__all__ = ["run"]

_DISTRIBUTIONS = (
    "torch",
    "triton",
    "numba",
    "numpy",
    "pyzmq",
    "zstandard",
    "xxhash",
    "pytest",
    "refit-core",
    "refit-zmq",
    "refit-nccl",
    "refit-lab",
    "refit-dynamo",
    "refit-sglang",
    "vllm",
    "ray",
)
_MODULES = ("refit_core", "refit_zmq", "refit_nccl", "refit_lab", "refit_dynamo", "refit_sglang")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports() -> dict[str, str]:
    """Module -> "ok" or the error its import raised."""
    outcome: dict[str, str] = {}
    for name in _MODULES:
        try:
            importlib.import_module(name)
            outcome[name] = "ok"
        except Exception as exc:
            outcome[name] = f"{type(exc).__name__}: {exc}"
    return outcome


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
    answer = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return answer.stdout.strip() or answer.stderr.strip()


def run() -> dict[str, Any]:
    """GPU, driver, CUDA, NCCL and package versions; ``ok`` when a GPU is usable and every
    refit package imports."""
    import torch

    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "name": props.name,
                "memory_bytes": props.total_memory,
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
            }
        )
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None  # type: ignore[no-untyped-call]
    imports = _imports()
    return {
        "ok": bool(devices) and all(v == "ok" for v in imports.values()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "devices": devices,
        "nvidia_smi": _nvidia_smi(),
        "versions": {d: _version(d) for d in _DISTRIBUTIONS},
        "imports": imports,
    }
