"""Plots of `refit bench all`, drawn from real runs of the benches at tiny sizes; the
`collective` bench's own checks, on the same run."""

from __future__ import annotations

import argparse
import io
import logging
import struct
import sys
import zlib
from pathlib import Path

import pytest

from refit_lab.bench import cli, codec, collective, relay
from refit_lab.bench.harness import BenchContext, BenchReport, machine_info
from refit_lab.bench.plots import (
    codec_series,
    collective_series,
    relay_series,
    write_plots,
)
from refit_lab.bench.ratio_check import Ratio, Side, Worst, check_summary_ratios

MiB = 1 << 20
CTX = BenchContext(quick=True, threads=1)
TINY_CODEC = codec.ModelShape(hidden=64, intermediate=176, vocab=512, layers=1)
TINY_RELAY = relay.Sizes(
    dense_bytes=4 * MiB, tree_bytes=4 * MiB, repeats=1, receivers=(1, 2), hidden=128
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def codec_report() -> BenchReport:
    return codec.measure(CTX, model=TINY_CODEC, repeats=1)


@pytest.fixture(scope="module")
def collective_report() -> BenchReport:
    return collective.measure(CTX, 2 * MiB, repeats=1, abort=False)


def _lowest(subject: str, reference: str) -> Worst:
    """``subject`` over ``reference`` at each receiver count; the summary keeps the lowest."""
    return Worst(
        [
            Ratio(
                Side("gbps", {"case": f"{subject} x{n}"}),
                Side("gbps", {"case": f"{reference} x{n}"}),
            )
            for n in collective.RECEIVERS
        ]
    )


COLLECTIVE_RATIOS = {
    "packed_vs_flat_throughput": _lowest("packed", "flat"),
    "packed_speedup_vs_per_tensor": _lowest("packed", "per_tensor"),
    "packed_copy_vs_flat_throughput": _lowest("packed_copy", "flat"),
    "packed_child_vs_packed_throughput": _lowest("packed_child", "packed"),
}
"""Each summary ratio of the `collective` bench: the rows it compares, subject first."""


def test_collective_run_is_bitexact_and_its_ratios_are_its_rows(
    collective_report: BenchReport,
) -> None:
    assert collective_report.summary["bitexact"] is True
    check_summary_ratios(collective_report, COLLECTIVE_RATIOS, other_keys={"memcpy_gbps"})


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG whose chunks all pass their CRC, IHDR first and IEND last."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    offset, kinds, size = 8, [], (0, 0)
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path.name}: bad CRC in {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        kinds.append(kind)
        offset += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    return size


def _check_png(path: Path) -> None:
    from matplotlib.image import imread

    width, height = _png_size(path)
    assert width > 100 and height > 100
    pixels = imread(path)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0, f"{path.name} is blank"


def test_series_come_from_the_measured_rows(
    codec_report: BenchReport, collective_report: BenchReport
) -> None:
    lines = codec_series(codec_report.results)
    assert set(lines) == set(codec.METHODS)
    assert all(len(points) == len(codec.ADAMW_FRACTIONS) for points in lines.values())
    assert all(x > 0 and y > 0 for points in lines.values() for x, y in points)
    assert [x for x, _ in lines["refit"]] == sorted(x for x, _ in lines["refit"])
    lines = collective_series(collective_report.results)
    assert set(lines) == {"flat", "packed", "packed_copy", "packed_child", "per_tensor"}
    assert all([x for x, _ in p] == list(collective.RECEIVERS) for p in lines.values())
    assert relay_series(codec_report.results) == {}


def test_plots_are_valid_pngs(
    codec_report: BenchReport, collective_report: BenchReport, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    reports = {"codec": codec_report, "collective": collective_report}
    written = write_plots(reports, tmp_path / "out")
    assert sorted(p.name for p in written) == ["codec_density.png", "collective_throughput.png"]
    for path in written:
        _check_png(path)


def test_relay_plot_is_skipped_without_the_shaped_sweep(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("matplotlib")
    report = relay.measure(CTX, TINY_RELAY, shaped_links=False)
    with caplog.at_level(logging.INFO, logger="refit_lab.bench.plots"):
        assert write_plots({"relay": report}, tmp_path) == []
    assert "no relay_receivers.png" in caplog.text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.netns
def test_relay_plot_of_tree_and_star_against_receivers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows, summary = relay.shaped(CTX, TINY_RELAY)
    report = BenchReport("relay", True, machine_info(), rows, summary)
    lines = relay_series(report.results)
    assert set(lines) == {"relay tree (fan-out 1)", "raw zmq star"}
    assert all([x for x, _ in p] == [1.0, 2.0] for p in lines.values())
    (path,) = write_plots({"relay": report}, tmp_path)
    assert path.name == "relay_receivers.png"
    _check_png(path)


def test_bench_all_writes_plots_next_to_the_json(
    codec_report: BenchReport,
    collective_report: BenchReport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("matplotlib")
    measured = {"codec": codec_report, "collective": collective_report}
    monkeypatch.setattr(cli, "BENCHES", dict.fromkeys(measured, "measured above"))
    monkeypatch.setattr(cli, "load_bench", lambda name: lambda ctx: measured[name])
    parser = argparse.ArgumentParser(prog="refit")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "all", "--quick", "--out-dir", str(tmp_path)])
    assert args.handler(args, stream=io.StringIO()) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "codec.json",
        "codec_density.png",
        "collective.json",
        "collective_throughput.png",
    ]


def test_without_matplotlib_plots_are_skipped_with_a_log(
    codec_report: BenchReport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.INFO, logger="refit_lab.bench.plots"):
        assert write_plots({"codec": codec_report}, tmp_path) == []
    assert "matplotlib is not installed" in caplog.text
    assert list(tmp_path.iterdir()) == []
