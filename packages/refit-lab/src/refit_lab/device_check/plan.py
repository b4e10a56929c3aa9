"""What the device check runs, and what must travel with the checkout for it to run.

The GPU machine reaches no package registry and its Python (3.12, torch 2.11 + CUDA 13) lacks
pyzmq and zstandard, so refit's own wheels and those two travel in an ignored folder
(``.device-check/`` by default) and are installed there with ``pip --no-index --no-deps
--target``; together with the working tree they must stay under the device tool's 64 MiB.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CODEC_BENCH_ARGS",
    "PHASES",
    "REFIT_PACKAGES",
    "THIRD_PARTY",
    "TRAVEL_LIMIT_BYTES",
    "Phase",
    "check_wheels",
    "codec_bench_args",
    "phase_command",
    "plan_text",
    "select_phases",
    "travelling_tree_bytes",
]

TRAVEL_LIMIT_BYTES = 64 * 1024 * 1024
"""What the device tool carries: the working tree plus the carried wheel folder."""

REFIT_PACKAGES = (
    "refit-core",
    "refit-zmq",
    "refit-nccl",
    "refit-dynamo",
    "refit-sglang",
    "refit-lab",
)
"""Built into wheels by ``--prepare`` (refit-lab's bench imports all of them)."""

THIRD_PARTY = {"pyzmq": "27.3.0", "zstandard": "0.25.0"}
"""What refit's packages import that the GPU machine's image lacks, at uv.lock's versions."""

PYTHON_TAG = "cp312"
"""The GPU machine's Python."""


@dataclass(frozen=True)
class Phase:
    """One phase of the check.

    Attributes:
        name: what ``PHASES`` names it by.
        timeout_s: the phase's own limit (its process is killed past it).
        what: one line for the plan and the summary.
        runs: the commands it runs besides its own Python (shown by the plan).
    """

    name: str
    timeout_s: float
    what: str
    runs: tuple[str, ...] = ()


GPU_TESTS = (
    "python3 -m pytest -m gpu --require-gpu -p no:cacheprovider -q -rs "
    "--junitxml=<tmp>/gpu-tests.xml <every test file that marks a test gpu>"
)
CODEC_BENCH_ARGS = f"--device cuda --bytes {8 << 30}"
"""``refit bench codec``'s arguments unless ``CODEC_BENCH_ARGS`` in the environment says
otherwise (the GPU encoder's bench options: ``--device``, and a size of at least 8 GiB)."""


def codec_bench_args() -> str:
    """``CODEC_BENCH_ARGS`` from the environment, else :data:`CODEC_BENCH_ARGS`."""
    return os.environ.get("CODEC_BENCH_ARGS", CODEC_BENCH_ARGS)


PHASES: tuple[Phase, ...] = (
    Phase("environment", 45, "GPU, driver, CUDA, NCCL and library versions; refit imports"),
    Phase(
        "references",
        75,
        "device-to-device copy, pinned and pageable host copies (4 GiB / 1 GiB), CUDA IPC "
        "read by a second process",
    ),
    Phase(
        "gpu-tests",
        150,
        "every gpu-marked test (those that need two GPUs, vLLM or Dynamo skip, with reasons)",
        (GPU_TESTS,),
    ),
    Phase(
        "ipc",
        75,
        "refit's colocated IPC channel on a 4 GiB bf16 CUDA state into a second process, "
        "against a device-to-device copy of the same bytes, interleaved",
    ),
    Phase(
        "codec",
        100,
        "GPU delta encoder at 1 % changed on 8 GiB against torch's ne/nonzero and the host "
        "path (refit bench codec --device cuda); sparse apply against a full reload",
        ("python3 -m refit_core.cli bench codec $CODEC_BENCH_ARGS --json <tmp>/codec.json",),
    ),
    Phase(
        "collective",
        45,
        "single-GPU NCCL group: eager connect, broadcast, abort, call after abort; an init a "
        "peer never completes ended at its deadline",
    ),
    Phase(
        "megatron",
        45,
        "Megatron colocated reshard on CUDA (the factory row, in place) against a "
        "device-to-device copy of the same bytes",
    ),
)
"""Every phase, in order; their timeouts add up to 535 s, so the whole check stays under
the device tool's 10 minutes."""


def select_phases(names: str | None) -> tuple[Phase, ...]:
    """The phases ``names`` (comma-separated, in the check's order) picks; all when empty.

    Raises:
        ValueError: an unknown phase name.
    """
    if not names or not names.strip():
        return PHASES
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {p.name for p in PHASES}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown phases {unknown}; known: {', '.join(p.name for p in PHASES)}")
    return tuple(p for p in PHASES if p.name in wanted)


def phase_command(phase: Phase, result: str) -> list[str]:
    """How the run starts ``phase`` (in a process of its own) writing its JSON to ``result``."""
    return ["python3", "-m", "refit_lab.device_check", "phase", phase.name, "--out", result]


_WHEEL = re.compile(
    r"^(?P<dist>[^-]+)-(?P<version>[^-]+)-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>.+)\.whl$"
)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def check_wheels(folder: Path, refit_version: str) -> list[str]:
    """Problems with the wheel folder (empty when the check can run from it).

    Every refit package at ``refit_version`` (pure Python), every :data:`THIRD_PARTY`
    distribution at its pin for CPython 3.12 on x86-64 manylinux, one wheel each.
    """
    if not folder.is_dir():
        return [f"{folder} does not exist: run scripts/device-check --prepare"]
    found: dict[str, list[re.Match[str]]] = {}
    problems: list[str] = []
    for path in sorted(folder.glob("*.whl")):
        match = _WHEEL.match(path.name)
        if match is None:
            problems.append(f"{path.name} is not a wheel file name")
            continue
        found.setdefault(_normalized(match["dist"]), []).append(match)
    wanted = {_normalized(p): (refit_version, "pure") for p in REFIT_PACKAGES}
    wanted |= {_normalized(d): (v, "cp312") for d, v in THIRD_PARTY.items()}
    for dist, (version, kind) in wanted.items():
        matches = found.get(dist, [])
        if not matches:
            problems.append(f"no wheel of {dist} {version}")
            continue
        if len(matches) > 1:
            names = ", ".join(m.string for m in matches)
            problems.append(f"{dist}: more than one wheel ({names}); pip would refuse them")
        wheel = matches[0]
        if wheel["version"] != version:
            problems.append(f"{wheel.string}: version {wheel['version']}, wanted {version}")
        if kind == "pure" and (wheel["abi"], wheel["platform"]) != ("none", "any"):
            problems.append(f"{wheel.string}: a refit wheel must be pure Python")
        if kind == "cp312" and not (
            wheel["python"] in (PYTHON_TAG, "py3") or wheel["abi"] == "abi3"
        ):
            problems.append(f"{wheel.string}: not for CPython 3.12")
        if kind == "cp312" and "x86_64" not in wheel["platform"] and wheel["platform"] != "any":
            problems.append(f"{wheel.string}: not for x86-64 Linux")
    extra = sorted(set(found) - set(wanted))
    problems += [f"unexpected wheel of {dist} (it would be installed too)" for dist in extra]
    return problems


def travelling_tree_bytes(root: Path) -> int:
    """Bytes of the tracked and untracked-not-ignored files under ``root`` (what travels
    besides carried folders)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    total = 0
    for name in listed.decode().split("\0"):
        path = root / name
        if name and path.is_file():
            total += path.stat().st_size
    return total


def plan_text(
    phases: Sequence[Phase], wheels: Path, problems: Sequence[str], tree_bytes: int
) -> str:
    """What ``scripts/device-check --plan`` prints."""
    wheel_bytes = sum(p.stat().st_size for p in wheels.glob("*.whl")) if wheels.is_dir() else 0
    total = tree_bytes + wheel_bytes
    mib = 1024 * 1024
    lines = [
        f"wheel folder {wheels}: {len(list(wheels.glob('*.whl'))) if wheels.is_dir() else 0} "
        f"wheels, {wheel_bytes / mib:.1f} MiB; working tree {tree_bytes / mib:.1f} MiB; "
        f"{total / mib:.1f} of {TRAVEL_LIMIT_BYTES / mib:.0f} MiB",
        *(f"  problem: {p}" for p in problems),
        "on the GPU machine (scripts/device-check OUT_DIR):",
        f"  python3 -m pip install -q --no-index --no-deps --no-compile --target <site> "
        f"{wheels}/*.whl",
    ]
    for phase in phases:
        lines.append(f"  [{phase.name}, {phase.timeout_s:.0f} s] {phase.what}")
        lines.append(f"    {' '.join(phase_command(phase, '<tmp>/' + phase.name + '.json'))}")
        lines += [
            f"    runs: {command.replace('$CODEC_BENCH_ARGS', codec_bench_args())}"
            for command in phase.runs
        ]
    budget = sum(p.timeout_s for p in phases)
    lines.append(f"phase timeouts add up to {budget:.0f} s (one device command: at most 600 s)")
    if total > TRAVEL_LIMIT_BYTES:
        lines.append("  problem: the tree and the wheels exceed what the device tool carries")
    return "\n".join(lines)


def env_phases() -> tuple[Phase, ...]:
    """The phases ``PHASES`` in the environment picks."""
    return select_phases(os.environ.get("PHASES"))
