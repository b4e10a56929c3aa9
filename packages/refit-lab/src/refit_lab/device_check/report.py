"""The check's verdicts: targets over the phases' results, and the summary for BENCHMARKS.md."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TARGETS", "PhaseOutcome", "Target", "evaluate", "markdown"]


@dataclass(frozen=True)
class Target:
    """A ratio a phase must reach on the GPU machine.

    Attributes:
        name: the ratio's name in the summary.
        phase: the phase whose result holds it.
        key: its key in that result.
        minimum: the target (the ratio must be at least this).
        reference: the key of the reference rate (GB/s) it is measured against.
        what: one line for the summary.
    """

    name: str
    phase: str
    key: str
    minimum: float
    reference: str
    what: str


TARGETS = (
    Target(
        "ipc_vs_device_copy",
        "ipc",
        "ipc_vs_device_copy",
        0.5,
        "device_copy_gbps",
        "colocated IPC refit of 4 GiB against a device-to-device copy of the same bytes",
    ),
    Target(
        "gpu_encode_vs_device_copy",
        "codec",
        "encode_vs_device_copy",
        0.5,
        "reference_gbps",
        "GPU delta encode at 1 % changed against a device-to-device copy of the same bytes",
    ),
    Target(
        "sparse_apply_vs_full_reload",
        "codec",
        "sparse_apply_vs_full_reload",
        10.0,
        "full_reload_gbps",
        "in-place sparse apply at 1 % against a full reload (pinned host-to-device copy)",
    ),
)


@dataclass(frozen=True)
class PhaseOutcome:
    """How one phase ended.

    Attributes:
        name: the phase.
        status: ``passed``, ``failed`` (its result says why), ``error`` (its process failed
            before writing a result), or ``timed_out``.
        wall_s: how long it ran.
        result: what it reported (empty unless it wrote a result).
        error: why it failed, where its result does not say.
    """

    name: str
    status: str
    wall_s: float
    result: Mapping[str, Any]
    error: str = ""


def evaluate(outcomes: Mapping[str, PhaseOutcome]) -> list[dict[str, Any]]:
    """Each target's value, reference rate and verdict (``pass`` None when not measured)."""
    verdicts: list[dict[str, Any]] = []
    for target in TARGETS:
        outcome = outcomes.get(target.phase)
        value = outcome.result.get(target.key) if outcome else None
        measured = isinstance(value, int | float) and not isinstance(value, bool)
        verdicts.append(
            {
                "name": target.name,
                "what": target.what,
                "target": f">= {target.minimum:g}",
                "value": value if measured else None,
                "reference_gbps": outcome.result.get(target.reference) if outcome else None,
                "pass": (float(value) >= target.minimum) if measured else None,  # type: ignore[arg-type]
                "why_not_measured": None
                if measured
                else (
                    "phase not run"
                    if outcome is None
                    else outcome.error or str(outcome.result.get("error", outcome.status))
                ),
            }
        )
    return verdicts


def _cell(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "-"}[value]
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(summary: Mapping[str, Any]) -> str:
    """The summary as a BENCHMARKS.md section: command, machine, references, targets, phases."""
    environment = summary["phases"].get("environment", {}).get("result", {})
    references = summary["phases"].get("references", {}).get("result", {})
    devices = environment.get("devices") or [{}]
    lines = [
        f"### Device check ({summary['started']})",
        "",
        f"Command: `{summary['command']}` (refit {summary.get('commit') or 'unknown commit'}).",
        f"Machine: {devices[0].get('name', '?')}, driver/clocks `{environment.get('nvidia_smi')}`, "
        f"torch {environment.get('versions', {}).get('torch')} (CUDA {environment.get('torch_cuda')}), "
        f"NCCL {environment.get('nccl')}, Python {environment.get('python')}.",
        "",
        "| reference | GB/s |",
        "|---|---|",
    ]
    lines += [
        f"| {key.removesuffix('_gbps')} | {_cell(value)} |"
        for key, value in references.items()
        if key.endswith("_gbps")
    ]
    lines += [
        "",
        "| target | value | needed | reference GB/s | verdict |",
        "|---|---|---|---|---|",
    ]
    for verdict in summary["targets"]:
        outcome = {
            True: "pass",
            False: "FAIL",
            None: f"not measured ({verdict['why_not_measured']})",
        }
        lines.append(
            f"| {verdict['what']} | {_cell(verdict['value'])} | {verdict['target']} | "
            f"{_cell(verdict['reference_gbps'])} | {outcome[verdict['pass']]} |"
        )
    lines += ["", "| phase | status | seconds |", "|---|---|---|"]
    for name, phase in summary["phases"].items():
        lines.append(f"| {name} | {phase['status']} | {phase['wall_s']:.1f} |")
    tests = summary["phases"].get("gpu-tests", {}).get("result", {})
    if tests:
        lines += [
            "",
            f"gpu-marked tests: {tests.get('passed', 0)} passed, {len(tests.get('failed', {}))} "
            f"failed, {len(tests.get('skipped', {}))} skipped (reasons in summary.json).",
        ]
    return "\n".join(lines) + "\n"
