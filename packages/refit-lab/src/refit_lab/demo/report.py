"""The demo's per-refit records, its final table and its JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_core.backend import align_columns
from refit_lab.serving_load import ServingCounts

__all__ = ["DemoReport", "RefitRecord"]

_MB = 1e6


@dataclass(frozen=True)
class RefitRecord:
    """One refit of the demo.

    Attributes:
        step: the training step it followed.
        outcome: ``committed``, ``rolled back`` / ``aborted`` (a faulted refit that failed as
            it must), or ``failed`` (an unexpected error).
        changed_fraction: bf16 elements that differ from the last committed weights.
        wire_bytes: bytes the transport sent.
        dense_bytes: bytes of the full state.
        refit_s: wall time of the refit (``sync_weights``, or staging plus commit).
        verified: committed refits: every live worker holds the trainer's bits, serves the new
            version and generates the trainer's greedy tokens; faulted ones: the refit failed
            with a typed error within the deadline and every survivor still serves (and, where
            the transport rolls back, holds) the previous version.
        loss: the training loss of the step.
        fault: the fault injected into this refit, if any.
        detail: what went wrong or what was checked, in words.
        pause_s: a staged refit's pause (``timings_s["pause"]``: the longest time an engine
            was held by the commit); None for a refit that was not staged.
    """

    step: int
    outcome: str
    changed_fraction: float
    wire_bytes: int
    dense_bytes: int
    refit_s: float
    verified: bool
    loss: float
    fault: str | None = None
    detail: str = ""
    pause_s: float | None = None

    @property
    def effective_gbps(self) -> float:
        """Dense bytes per second of refit (GB/s); 0 for a refit that did not commit."""
        if self.outcome != "committed" or self.refit_s <= 0:
            return 0.0
        return self.dense_bytes / self.refit_s / 1e9

    def to_json(self) -> dict[str, Any]:
        """The JSON shape of one step."""
        return {
            "step": self.step,
            "changed_fraction": self.changed_fraction,
            "wire_bytes": self.wire_bytes,
            "dense_bytes": self.dense_bytes,
            "refit_s": self.refit_s,
            "pause_ms": None if self.pause_s is None else 1e3 * self.pause_s,
            "verified": self.verified,
            "outcome": self.outcome,
            "effective_gbps": self.effective_gbps,
            "loss": self.loss,
            "fault": self.fault,
            "detail": self.detail,
        }


@dataclass
class DemoReport:
    """Every refit of one demo run, and (``--inflight``) the requests served through them."""

    transport: str
    workers: int
    records: list[RefitRecord] = field(default_factory=list)
    serving: ServingCounts | None = None

    @property
    def ok(self) -> bool:
        """True when every refit verified and no request was lost."""
        served = self.serving is None or (self.serving.submitted > 0 and not self.serving.lost)
        return bool(self.records) and all(r.verified for r in self.records) and served

    def to_json(self) -> dict[str, Any]:
        """``{"transport", "workers", "steps": [...], "serving"}`` (serving: null, or the
        requests ``submitted``, ``completed`` and ``lost`` while the engines were refitted)."""
        serving = self.serving
        return {
            "transport": self.transport,
            "workers": self.workers,
            "steps": [record.to_json() for record in self.records],
            "serving": None
            if serving is None
            else {
                "submitted": serving.submitted,
                "completed": serving.completed,
                "lost": serving.lost,
                "errors": serving.errors[:5],
            },
        }

    def write_json(self, path: Path) -> None:
        """Write :meth:`to_json` to ``path`` (parents created)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> str:
        """The final table, one row per refit."""
        staged = any(r.pause_s is not None for r in self.records)
        headers = ("step", "outcome", "changed %", "wire MB", "dense MB", "wire/dense",
                   "refit s", *(("pause ms",) if staged else ()), "GB/s", "loss",
                   "verified")  # fmt: skip
        rows = [
            (
                f"{r.step}" + (f" ({r.fault})" if r.fault else ""),
                r.outcome,
                f"{100 * r.changed_fraction:.2f}",
                f"{r.wire_bytes / _MB:.2f}",
                f"{r.dense_bytes / _MB:.2f}",
                f"{r.wire_bytes / r.dense_bytes:.3f}" if r.dense_bytes else "-",
                f"{r.refit_s:.3f}",
                *((f"{1e3 * r.pause_s:.1f}" if r.pause_s is not None else "-",) if staged else ()),
                f"{r.effective_gbps:.2f}",
                f"{r.loss:.4f}",
                "yes" if r.verified else "NO",
            )
            for r in self.records
        ]
        lines = align_columns([headers, *rows], right=True, rule=True)
        lines += [f"step {r.step}: {r.detail}" for r in self.records if r.detail]
        if self.serving is not None:
            lines.append(
                f"serving: {self.serving.submitted} requests through the run, "
                f"{self.serving.completed} complete, {self.serving.lost} lost"
            )
        return "\n".join(lines)
