"""Tests of the bench harness, the references (tiny sizes) and the `refit bench` command."""

from __future__ import annotations

import argparse
import io
import json
import math
import operator
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from refit_lab.bench import baseline, cli
from refit_lab.bench.cli import register
from refit_lab.bench.harness import (
    BENCHES,
    BenchContext,
    BenchReport,
    PairedRatio,
    TimingStats,
    format_table,
    gbps,
    load_bench,
    machine_info,
    rate_fields,
    timeit,
    write_json,
)
from refit_lab.bench.ratio_check import Ratio, Side, Worst, check_summary_ratios
from refit_lab.bench.runtime import ChildGroup, Deadline, free_port

SUMMARY_KEYS = {"memcpy_gbps", "gloo_broadcast_gbps", "zmq_stream_gbps"}


def _report(**overrides: object) -> BenchReport:
    fields: dict[str, object] = {
        "bench": "demo",
        "quick": True,
        "machine": machine_info(),
        "results": [{"case": "a", "gbps": 1.5, "nbytes": 10}, {"case": "b", "ok": True}],
        "summary": {"a_gbps": 1.5, "ok": True, "count": 2},
    }
    fields.update(overrides)
    return BenchReport(**fields)  # type: ignore[arg-type]


def _check_shape(doc: dict[str, object]) -> None:
    assert set(doc) == {"bench", "quick", "machine", "results", "summary"}
    assert isinstance(doc["bench"], str)
    assert isinstance(doc["quick"], bool)
    assert isinstance(doc["machine"], dict)
    assert isinstance(doc["results"], list)
    assert doc["results"]
    assert all(isinstance(r, dict) and isinstance(r["case"], str) for r in doc["results"])
    assert isinstance(doc["summary"], dict)
    assert all(isinstance(v, int | float | bool) for v in doc["summary"].values())


def test_to_json_shape_and_file(tmp_path: Path) -> None:
    report = _report()
    doc = report.to_json()
    _check_shape(doc)
    path = write_json(report, tmp_path / "nested" / "dir" / "demo.json")
    assert json.loads(path.read_text()) == doc


def test_machine_info_is_hostname_free() -> None:
    info = machine_info()
    assert {"python", "torch", "cpu_count", "cpu_model", "memory_total_bytes", "platform"} <= set(
        info
    )
    assert socket.gethostname() not in info.values()


@pytest.mark.parametrize(
    ("results", "summary"),
    [
        ([{"gbps": 1.0}], {"x": 1.0}),
        ([{"case": "a"}], {"x": "fast"}),
        ([{"case": "a"}], {"x": math.nan}),
        ([{"case": "a"}], {"x": None}),
    ],
)
def test_report_validation(results: list[dict[str, object]], summary: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="demo"):
        _report(results=results, summary=summary)


def test_registry() -> None:
    assert BENCHES["baseline"] == "refit_lab.bench.baseline:run"
    assert load_bench("baseline") is baseline.run
    with pytest.raises(ValueError, match=r"known benches: .*baseline"):
        load_bench("nope")


def test_timing_helpers() -> None:
    calls: list[int] = []
    stats = timeit(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5
    assert stats.repeats == 3
    assert 0 <= stats.min_s <= stats.median_s
    assert TimingStats.from_samples([1.0, 2.0, 6.0]) == TimingStats(1.0, 2.0, 3.0, 3)
    assert gbps(2_000_000_000, 2.0) == 1.0
    with pytest.raises(ValueError, match="repeats"):
        timeit(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="seconds"):
        gbps(1, 0.0)


def test_format_table() -> None:
    table = format_table(_report())
    lines = table.splitlines()
    assert lines[0] == "bench demo (quick)"
    assert lines[1].split() == ["case", "gbps", "nbytes", "ok"]
    assert "a_gbps = 1.5" in lines


def test_context_validates_threads() -> None:
    assert BenchContext().threads >= 1
    with pytest.raises(ValueError, match="threads"):
        BenchContext(threads=0)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_child_group_results_and_failures() -> None:
    deadline = Deadline(30.0, "test")
    with ChildGroup(operator.add, [(2, 3), (4, 5)], deadline=deadline, name="add") as group:
        assert group.results() == [5, 9]
    with (
        pytest.raises(ChildProcessError, match="ZeroDivisionError"),
        ChildGroup(operator.truediv, [(1, 0)], deadline=deadline, name="div") as group,
    ):
        group.results()
    with (
        pytest.raises(ChildProcessError, match="without a result"),
        ChildGroup(os._exit, [(3,)], deadline=deadline, name="exit") as group,
    ):
        group.results()


def test_child_group_deadline_kills_child() -> None:
    start = time.monotonic()
    with (
        pytest.raises(TimeoutError, match="sleepy"),
        ChildGroup(time.sleep, [(60,)], deadline=Deadline(1.0, "sleepy"), name="sleep") as group,
    ):
        group.results()
    assert time.monotonic() - start < 20


def test_baseline_tiny_sizes() -> None:
    seen: list[float] = []
    ctx = BenchContext(quick=True, threads=1, progress=lambda _msg, frac: seen.append(frac))
    report = baseline.measure(ctx, nbytes=3 * (1 << 20) + 7, repeats=2)
    doc = report.to_json()
    _check_shape(doc)
    assert set(report.summary) == SUMMARY_KEYS
    assert all(isinstance(v, float) and v > 0 for v in report.summary.values())
    assert [r["case"] for r in report.results] == ["memcpy", "gloo_broadcast", "zmq_stream"]
    assert seen[0] == 0.0
    assert seen[-1] == 1.0


def _stub_bench(name: str) -> Callable[[BenchContext], BenchReport]:
    """Stands in for `load_bench`, so CLI tests run no real bench."""
    if name not in BENCHES:
        raise ValueError(name)

    def run(ctx: BenchContext) -> BenchReport:
        return BenchReport(
            bench=name,
            quick=ctx.quick,
            machine=machine_info(),
            results=[{"case": "stub", "threads": ctx.threads}],
            summary={"x_gbps": 1.0},
        )

    return run


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="refit")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "load_bench", _stub_bench)
    out = tmp_path / "sub" / "baseline.json"
    args = _parse(["bench", "baseline", "--quick", "--json", str(out), "--threads", "1"])
    stream = io.StringIO()
    assert args.handler(args, stream=stream) == 0
    doc = json.loads(out.read_text())
    _check_shape(doc)
    assert doc["bench"] == "baseline"
    assert doc["quick"] is True
    assert doc["results"] == [{"case": "stub", "threads": 1}]
    assert "bench baseline (quick)" in stream.getvalue()


def test_cli_all_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "load_bench", _stub_bench)
    args = _parse(["bench", "all", "--out-dir", str(tmp_path / "res")])
    assert args.handler(args, stream=io.StringIO()) == 0
    written = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert written == sorted(f"{n}.json" for n in BENCHES)
    assert json.loads((tmp_path / "res" / "baseline.json").read_text())["bench"] == "baseline"
    args = _parse(["bench", "all", "--json", str(tmp_path / "x.json")])
    assert args.handler(args, stream=io.StringIO()) == 2

    def boom(ctx: BenchContext) -> BenchReport:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "load_bench", lambda name: boom)
    args = _parse(["bench", "baseline"])
    assert args.handler(args, stream=io.StringIO()) == 1
    with pytest.raises(SystemExit):
        _parse(["bench", "nope"])
    with pytest.raises(SystemExit):
        _parse(["bench", "baseline", "--threads", "0"])
    args = _parse(["bench", "baseline", "--device", "cuda"])
    assert args.handler(args, stream=io.StringIO()) == 2
    args = _parse(["bench", "baseline", "--bytes", "1024"])
    assert args.handler(args, stream=io.StringIO()) == 2


def test_cli_passes_device_and_size_to_sized_benches(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BenchContext] = []

    def record(name: str) -> Callable[[BenchContext], BenchReport]:
        def run(ctx: BenchContext) -> BenchReport:
            seen.append(ctx)
            return _stub_bench(name)(ctx)

        return run

    monkeypatch.setattr(cli, "load_bench", record)
    args = _parse(["bench", "codec", "--device", "cuda", "--bytes", "8589934592", "--quick"])
    assert args.handler(args, stream=io.StringIO()) == 0
    assert (seen[0].device, seen[0].size_bytes, seen[0].quick) == ("cuda", 8 << 30, True)
    with pytest.raises(SystemExit):
        _parse(["bench", "codec", "--device", "tpu"])


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    # round 2 is slow for both sides (load): its ratio is still 0.5
    pair = PairedRatio.of(subject_s=[2.0, 8.0, 2.2], reference_s=[1.0, 4.0, 1.0], nbytes=10**9)
    assert pair.ratio == pytest.approx(0.5)
    assert pair.time_ratio == pytest.approx(2.0)
    assert pair.reference_gbps == pytest.approx(1.0)
    assert pair.subject_gbps == pytest.approx(1 / 2.2)
    assert pair.rounds == 3
    assert pair.summary("x") == {"x": pair.ratio, "x_reference_gbps": pair.reference_gbps}
    assert pair.summary("t", time=True)["t"] == pair.time_ratio
    with pytest.raises(ValueError, match="paired"):
        PairedRatio.of(subject_s=[1.0], reference_s=[1.0, 2.0], nbytes=1)


def test_paired_ratio_takes_its_sides_only_by_name() -> None:
    with pytest.raises(TypeError):
        PairedRatio.of([2.0], [1.0], 10**9)  # type: ignore[misc]


def _paired_report(summary: dict[str, float | bool]) -> BenchReport:
    ours = PairedRatio.of(subject_s=[2.0, 1.0, 3.0], reference_s=[1.0, 1.0, 1.0], nbytes=10**9)
    return BenchReport(
        bench="demo",
        quick=True,
        machine={},
        results=[
            {"case": "ours", **rate_fields("gbps", ours.subject_rounds_gbps)},
            {"case": "raw", **rate_fields("gbps", ours.reference_rounds_gbps)},
        ],
        summary=summary,
    )


RATIOS = {"ours_vs_raw": Ratio(Side("gbps", {"case": "ours"}), Side("gbps", {"case": "raw"}))}


def test_ratio_check_accepts_the_ratio_its_rows_give() -> None:
    ours = PairedRatio.of(subject_s=[2.0, 1.0, 3.0], reference_s=[1.0, 1.0, 1.0], nbytes=10**9)
    report = _paired_report({**ours.summary("ours_vs_raw"), "ok": True})
    check_summary_ratios(report, RATIOS)
    assert ours.ratio == pytest.approx(0.5)


def test_ratio_check_fails_an_inverted_ratio() -> None:
    inverted = PairedRatio.of(subject_s=[1.0, 1.0, 1.0], reference_s=[2.0, 1.0, 3.0], nbytes=10**9)
    with pytest.raises(AssertionError, match=r"ours_vs_raw = 2\.0, but its rows give 0\.5"):
        check_summary_ratios(_paired_report(inverted.summary("ours_vs_raw")), RATIOS)


def test_ratio_check_fails_a_mislabeled_reference_rate_and_an_unchecked_ratio() -> None:
    ours = PairedRatio.of(subject_s=[2.0, 1.0, 3.0], reference_s=[1.0, 1.0, 1.0], nbytes=10**9)
    summary = {"ours_vs_raw": ours.ratio, "ours_vs_raw_reference_gbps": ours.subject_gbps}
    with pytest.raises(AssertionError, match="reference_gbps = 0.5, but the reference's rows"):
        check_summary_ratios(_paired_report(summary), RATIOS)
    with pytest.raises(AssertionError, match="'extra_ratio' is neither"):
        check_summary_ratios(
            _paired_report({**ours.summary("ours_vs_raw"), "extra_ratio": 1.0}), RATIOS
        )
    check_summary_ratios(
        _paired_report({**ours.summary("ours_vs_raw"), "extra_ratio": 1.0}),
        RATIOS,
        other_keys={"extra_ratio"},
    )


def test_ratio_check_takes_time_ratios_worst_of_several_and_one_row_per_round() -> None:
    rows: list[dict[str, object]] = [
        {"case": "a", "mode": "x", "pause_ms": 1.0, **rate_fields("gbps", [1.0, 2.0])},
        {"case": "b", "mode": "y", "pause_ms": 4.0, **rate_fields("gbps", [4.0, 4.0])},
        {"case": "c", "mode": "x", "pause_ms": 3.0},
        {"case": "d", "mode": "y", "pause_ms": 4.0},
    ]
    ratios = {
        "a_time_vs_b": Ratio(Side("gbps", {"case": "a"}), Side("gbps", {"case": "b"}), time=True),
        "worst": Worst(
            [
                Ratio(Side("gbps", {"case": "a"}), Side("gbps", {"case": "b"})),
                Ratio(Side("gbps", {"case": "b"}), Side("gbps", {"case": "a"})),
            ]
        ),
        "pause_x_vs_y": Ratio(Side("pause_ms", {"mode": "x"}), Side("pause_ms", {"mode": "y"})),
    }
    summary: dict[str, float | bool] = {
        "a_time_vs_b": 3.0,  # median of 4 / 1 and 4 / 2
        "a_time_vs_b_reference_gbps": 4.0,
        "worst": 0.375,  # median of 1 / 4 and 2 / 4
        "pause_x_vs_y": 0.5,  # median of 1 / 4 and 3 / 4
    }
    report = BenchReport(bench="demo", quick=True, machine={}, results=rows, summary=summary)
    check_summary_ratios(report, ratios)
    rows[0]["gbps"] = 2.0  # a recorded median that is not its rounds' median
    with pytest.raises(AssertionError, match="is not the median of its rounds"):
        check_summary_ratios(report, ratios)


def test_the_table_leaves_the_rounds_to_the_json() -> None:
    report = _paired_report({})
    table = format_table(report)
    assert "gbps" in table and "gbps_rounds" not in table
    assert report.to_json()["results"][0]["gbps_rounds"] == [0.5, 1.0, 1 / 3]  # type: ignore[index]
