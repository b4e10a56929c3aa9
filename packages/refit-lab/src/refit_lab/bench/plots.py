"""PNG plots of bench reports, drawn with matplotlib (Agg) where it is installed.

Three plots, each from one bench's results: refit time against receivers for the relay tree
and the raw star (``relay``, shaped links only), encode throughput against the fraction of
changed elements (``codec``), and packed (in process and in a killable child), flat and
per-tensor broadcast throughput against receivers (``collective``). A plot whose bench did
not run, or did not measure its cases, is skipped with an INFO log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from refit_lab.bench.harness import BenchReport

logger = logging.getLogger(__name__)

Series = dict[str, list[tuple[float, float]]]
"""Line label -> (x, y) points, sorted by x."""

Rows = list[dict[str, object]]

RELAY_CASES = {"shaped_tree_dense": "relay tree (fan-out 1)", "shaped_star_dense": "raw zmq star"}
CODEC_METHODS = ("refit", "xor_zstd", "nemo", "numpy_naive")
CODEC_CASE_PREFIX = "adamw_"
COLLECTIVE_CASES = ("packed", "packed_copy", "packed_child", "flat", "per_tensor")


def _number(row: dict[str, object], key: str) -> float:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{key} is not a number in {row!r}")
    return float(value)


def _sorted(series: Series) -> Series:
    return {label: sorted(points) for label, points in series.items() if points}


def relay_series(rows: Rows) -> Series:
    """Seconds per dense refit against receivers: the relay tree and the raw star."""
    series: Series = {label: [] for label in RELAY_CASES.values()}
    for row in rows:
        label = RELAY_CASES.get(str(row["case"]))
        if label is not None:
            series[label].append((_number(row, "receivers"), _number(row, "seconds")))
    return _sorted(series)


def codec_series(rows: Rows) -> Series:
    """Encode GB/s of every delta method against the fraction of changed elements (AdamW)."""
    series: Series = {method: [] for method in CODEC_METHODS}
    for row in rows:
        method = str(row.get("method"))
        if method in series and str(row["case"]).startswith(CODEC_CASE_PREFIX):
            series[method].append((_number(row, "changed_fraction"), _number(row, "encode_gbps")))
    return _sorted(series)


def collective_series(rows: Rows) -> Series:
    """Broadcast GB/s of every way to send against receivers."""
    series: Series = {case: [] for case in COLLECTIVE_CASES}
    for row in rows:
        case, _, receivers = str(row["case"]).rpartition(" x")
        if case in series and receivers.isdigit():
            series[case].append((_number(row, "receivers"), _number(row, "gbps")))
    return _sorted(series)


@dataclass(frozen=True)
class Plot:
    """One PNG: which bench it reads, how its lines come out of the results, and its axes."""

    bench: str
    filename: str
    title: str
    xlabel: str
    ylabel: str
    series: Callable[[Rows], Series]
    logx: bool = False
    logy: bool = False


PLOTS = (
    Plot(
        "relay",
        "relay_receivers.png",
        "Dense refit over shaped 500 Mbit/s links",
        "receivers",
        "refit time (s, median)",
        relay_series,
    ),
    Plot(
        "codec",
        "codec_density.png",
        "Delta encode throughput against density",
        "fraction of bf16 elements changed",
        "encode throughput (GB/s of dense bytes)",
        codec_series,
        logx=True,
    ),
    Plot(
        "collective",
        "collective_throughput.png",
        "Broadcast throughput over gloo",
        "receivers",
        "throughput (GB/s)",
        collective_series,
        logy=True,
    ),
)


def write_plots(reports: Mapping[str, BenchReport], out_dir: Path) -> list[Path]:
    """Draw every plot whose bench is in ``reports`` into ``out_dir``; the files written
    (none, with an INFO log, when matplotlib is not installed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.info("matplotlib is not installed: no plots (it is in the dev dependency group)")
        return []
    written: list[Path] = []
    for plot in PLOTS:
        report = reports.get(plot.bench)
        series = plot.series(report.results) if report is not None else {}
        if not series:
            logger.info("no %s: no %s results with its cases", plot.filename, plot.bench)
            continue
        figure = Figure(figsize=(6.4, 4.2), layout="constrained")
        FigureCanvasAgg(figure)  # draw with Agg, whatever the default backend
        axes = figure.add_subplot()
        for label, points in series.items():
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o", label=label)
        if plot.logx:
            axes.set_xscale("log")
        else:
            axes.set_xticks(sorted({x for points in series.values() for x, _ in points}))
        if plot.logy:
            axes.set_yscale("log")
        else:
            axes.set_ylim(bottom=0)
        axes.set(title=plot.title, xlabel=plot.xlabel, ylabel=plot.ylabel)
        axes.grid(alpha=0.3)
        axes.legend()
        path = out_dir / plot.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
        logger.info("wrote %s", path)
        written.append(path)
    return written
