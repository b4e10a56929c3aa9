"""Bench harness: context, report, registry, timing and output helpers shared by every bench."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from refit_core.backend import align_columns
from refit_lab.bench.runtime import default_threads

__all__ = [
    "BENCHES",
    "BenchContext",
    "BenchFn",
    "BenchReport",
    "PairedRatio",
    "ProgressHook",
    "TimingStats",
    "format_table",
    "gbps",
    "load_bench",
    "log_progress",
    "machine_info",
    "median_ratio",
    "rate_fields",
    "timeit",
    "write_json",
]

logger = logging.getLogger(__name__)

ProgressHook = Callable[[str, float], None]
"""Called as `progress(message, fraction_done)` with fraction_done in [0, 1]."""

BENCHES: dict[str, str] = {
    "baseline": "refit_lab.bench.baseline:run",
    "collective": "refit_lab.bench.collective:run",
    "inflight": "refit_lab.bench.inflight:run",
    "inflight_vllm": "refit_lab.bench.inflight_vllm:run",
    "ipc": "refit_lab.bench.ipc:run",
    "lora": "refit_lab.bench.lora:run",
    "codec": "refit_lab.bench.codec:run",
    "megatron": "refit_lab.bench.megatron:run",
    "relay": "refit_lab.bench.relay:run",
    "scale": "refit_lab.bench.scale:run",
    "sglang": "refit_lab.bench.sglang:run",
    "vllm": "refit_lab.bench.vllm:run",
}
"""Registry: bench name -> "module:function" of a `BenchFn`, imported on first use."""


class BenchUnavailableError(RuntimeError):
    """A bench that cannot run in this environment (its engine is not installed); `refit bench
    all` skips it, naming why."""


def log_progress(message: str, fraction: float) -> None:
    """Default progress hook: log at INFO."""
    logger.info("[%3.0f%%] %s", 100 * fraction, message)


SIZED_BENCHES = ("codec",)
"""Benches that take ``device`` and ``size_bytes`` (the others refuse them)."""


@dataclass(frozen=True)
class BenchContext:
    """How to run a bench: quick or full sizes, torch threads for everything measured, progress;
    for :data:`SIZED_BENCHES` also the device (``"cpu"`` or ``"cuda"``) and the state's size
    (None: the bench's quick or full size)."""

    quick: bool = False
    threads: int = field(default_factory=default_threads)
    progress: ProgressHook = log_progress
    device: str = "cpu"
    size_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.size_bytes is not None and self.size_bytes < 1:
            raise ValueError(f"size_bytes must be >= 1, got {self.size_bytes}")

    @property
    def default_sizes(self) -> bool:
        """Whether the bench runs on the CPU at its own quick or full size."""
        return self.device == "cpu" and self.size_bytes is None


@dataclass
class BenchReport:
    """One bench run; `to_json` gives the on-disk shape."""

    bench: str
    quick: bool
    machine: dict[str, object]
    results: list[dict[str, object]]
    summary: dict[str, float | bool]

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        for result in self.results:
            if not isinstance(result.get("case"), str):
                raise ValueError(f"bench {self.bench!r}: result without a str 'case': {result!r}")
        for key, value in self.summary.items():
            if not isinstance(value, bool | int | float) or (
                isinstance(value, float) and not math.isfinite(value)
            ):
                raise ValueError(
                    f"bench {self.bench!r}: summary {key!r} must be a finite number or bool,"
                    f" got {value!r}"
                )

    def to_json(self) -> dict[str, object]:
        """`{"bench", "quick", "machine", "results": [{"case", ...}], "summary"}`, validated."""
        self._validate()
        return {
            "bench": self.bench,
            "quick": self.quick,
            "machine": dict(self.machine),
            "results": [dict(result) for result in self.results],
            "summary": dict(self.summary),
        }


BenchFn = Callable[[BenchContext], BenchReport]


def load_bench(name: str) -> BenchFn:
    """Import the bench registered as `name` in `BENCHES`."""
    try:
        target = BENCHES[name]
    except KeyError:
        known = ", ".join(sorted(BENCHES))
        raise ValueError(f"unknown bench {name!r}; known benches: {known}") from None
    module_name, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"bench {name!r}: {target} is not callable")
    return cast(BenchFn, fn)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def machine_info() -> dict[str, object]:
    """What the numbers were measured on (no hostname)."""
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "pyzmq": _version("pyzmq"),
        "cpu_count": os.cpu_count(),
        "cpu_available": default_threads(),
        "cpu_model": _cpu_model(),
        "memory_total_bytes": _memory_total_bytes(),
        "platform": platform.platform(),
    }


@dataclass(frozen=True)
class TimingStats:
    """Summary of timed repeats, in seconds."""

    min_s: float
    median_s: float
    mean_s: float
    repeats: int

    @classmethod
    def from_samples(cls, samples_s: list[float]) -> TimingStats:
        """Summarise measured durations."""
        if not samples_s:
            raise ValueError("no timing samples")
        return cls(
            min_s=min(samples_s),
            median_s=statistics.median(samples_s),
            mean_s=statistics.fmean(samples_s),
            repeats=len(samples_s),
        )


def timeit(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> TimingStats:
    """Call `fn` `warmup` times untimed, then time `repeats` calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return TimingStats.from_samples(samples)


@dataclass(frozen=True)
class PairedRatio:
    """A subject against its reference, timed in the same interleaved rounds.

    Built only with keywords (:meth:`of`), so the subject and the reference cannot trade
    places unseen; every ratio a report's summary carries is checked against the rows the
    bench records (:mod:`refit_lab.bench.ratio_check`).

    Attributes:
        subject_rounds_gbps: the subject's rate in each round.
        reference_rounds_gbps: the reference's rate in the same rounds.
    """

    subject_rounds_gbps: tuple[float, ...]
    reference_rounds_gbps: tuple[float, ...]

    @classmethod
    def of(
        cls,
        *,
        subject_s: Sequence[float],
        reference_s: Sequence[float],
        nbytes: int,
        reference_nbytes: int | None = None,
    ) -> PairedRatio:
        """From per-round seconds of the subject (moving ``nbytes``) and of the reference
        (moving ``reference_nbytes``, default the same bytes)."""
        if len(subject_s) != len(reference_s) or not subject_s:
            raise ValueError(f"need paired rounds, got {len(subject_s)} and {len(reference_s)}")
        ref_bytes = nbytes if reference_nbytes is None else reference_nbytes
        return cls(
            subject_rounds_gbps=tuple(gbps(nbytes, s) for s in subject_s),
            reference_rounds_gbps=tuple(gbps(ref_bytes, s) for s in reference_s),
        )

    @property
    def ratio(self) -> float:
        """How many times faster the subject is: the median over rounds of that round's
        subject rate / reference rate, so a load that slows one round slows both sides of
        its ratio."""
        return median_ratio(self.subject_rounds_gbps, self.reference_rounds_gbps)

    @property
    def time_ratio(self) -> float:
        """How many times longer the subject takes (for the same bytes): the median over
        rounds of reference rate / subject rate."""
        return median_ratio(self.reference_rounds_gbps, self.subject_rounds_gbps)

    @property
    def subject_gbps(self) -> float:
        """The subject's median rate."""
        return statistics.median(self.subject_rounds_gbps)

    @property
    def reference_gbps(self) -> float:
        """The reference's median rate (recorded beside every ratio, so a reference slowed by
        load shows up instead of flattering the ratio)."""
        return statistics.median(self.reference_rounds_gbps)

    @property
    def rounds(self) -> int:
        """Rounds paired."""
        return len(self.subject_rounds_gbps)

    def summary(self, key: str, *, time: bool = False) -> dict[str, float]:
        """``{key: ratio, key + "_reference_gbps": reference rate}`` for a report summary
        (``time``: the :attr:`time_ratio`)."""
        return {
            key: self.time_ratio if time else self.ratio,
            f"{key}_reference_gbps": self.reference_gbps,
        }


def median_ratio(subjects: Sequence[float], references: Sequence[float]) -> float:
    """The median over paired rounds of subject / reference."""
    if len(subjects) != len(references) or not subjects:
        raise ValueError(f"need paired rounds, got {len(subjects)} and {len(references)}")
    return statistics.median(s / r for s, r in zip(subjects, references, strict=True))


def rate_fields(key: str, rounds_gbps: Sequence[float]) -> dict[str, object]:
    """A result row's record of one measured rate: ``{key: median, key + "_rounds": [...]}``
    (the per-round rates the summary's ratios are checked against)."""
    return {key: statistics.median(rounds_gbps), f"{key}_rounds": list(rounds_gbps)}


def gbps(nbytes: int, seconds: float) -> float:
    """Rate in GB/s (1e9 bytes per second)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return nbytes / seconds / 1e9


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(isinstance(v, float) for v in value):
        return "[" + " ".join(f"{v:.3g}" for v in value) + "]"
    return str(value)


def format_table(report: BenchReport) -> str:
    """The report as a plain-text table: one row per result (without the per-round
    ``*_rounds`` lists, which stay in the JSON), then the summary."""
    columns: list[str] = []
    for result in report.results:
        columns.extend(key for key in result if key not in columns and not key.endswith("_rounds"))
    rows = [columns, *[[_cell(r.get(c, "")) for c in columns] for r in report.results]]
    lines = [f"bench {report.bench} ({'quick' if report.quick else 'full'})"]
    lines += align_columns(rows)
    lines += [f"{key} = {_cell(value)}" for key, value in report.summary.items()]
    return "\n".join(line.rstrip() for line in lines)


def write_json(report: BenchReport, path: str | os.PathLike[str]) -> Path:
    """Write the report's JSON to `path`, creating parent directories; return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_json(), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    logger.info("wrote %s", out)
    return out
