"""Run the phases on the GPU machine, each in a process of its own under its own timeout, and
write ``summary.json``, ``summary.md`` and ``device-check.log`` (three files: the device tool
brings back at most eight)."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from refit_lab.device_check.plan import Phase, phase_command
from refit_lab.device_check.report import PhaseOutcome, evaluate, markdown

__all__ = ["run_check", "run_phase"]

logger = logging.getLogger(__name__)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Kill the phase's whole process group (its children: a spawned engine, pytest's)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_phase(phase: Phase, tmp: Path, log: IO[str]) -> PhaseOutcome:
    """Run ``phase`` with its timeout; its output goes to ``log``."""
    result_path = tmp / f"{phase.name}.json"
    command = phase_command(phase, str(result_path))
    command[0] = sys.executable
    log.write(f"\n=== phase {phase.name} (timeout {phase.timeout_s:.0f} s): {' '.join(command)}\n")
    log.flush()
    started = time.monotonic()
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        returncode = process.wait(timeout=phase.timeout_s)
    except subprocess.TimeoutExpired:
        _stop(process)
        wall = time.monotonic() - started
        return PhaseOutcome(
            phase.name, "timed_out", wall, {}, f"killed after {phase.timeout_s:.0f} s"
        )
    wall = time.monotonic() - started
    if not result_path.exists():
        return PhaseOutcome(phase.name, "error", wall, {}, f"exited {returncode} without a result")
    result: dict[str, Any] = json.loads(result_path.read_text())
    status = "passed" if returncode == 0 and result.get("ok") else "failed"
    return PhaseOutcome(
        phase.name, status, wall, result, "" if status == "passed" else str(result.get("error", ""))
    )


def run_check(
    out: Path,
    phases: Sequence[Phase],
    command: str,
    commit: str | None,
    progress: Callable[[str], None] = logger.info,
) -> dict[str, Any]:
    """Run ``phases`` in order and write the three files into ``out``; the summary.
    ``progress`` hears of each phase as it ends."""
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC)
    clock = time.monotonic()
    outcomes: dict[str, PhaseOutcome] = {}
    with tempfile.TemporaryDirectory() as tmp, (out / "device-check.log").open("w") as log:
        for phase in phases:
            outcome = run_phase(phase, Path(tmp), log)
            outcomes[phase.name] = outcome
            progress(f"{phase.name}: {outcome.status} ({outcome.wall_s:.1f} s)")
    summary: dict[str, Any] = {
        "command": command,
        "commit": commit,
        "started": started.isoformat(timespec="seconds"),
        "wall_s": time.monotonic() - clock,
        "phases": {
            name: {
                "status": o.status,
                "wall_s": o.wall_s,
                "error": o.error,
                "result": dict(o.result),
            }
            for name, o in outcomes.items()
        },
        "targets": evaluate(outcomes),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    return summary
