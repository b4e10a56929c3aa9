"""The `ipc` bench at a tiny size: registration, a bit-exact refit into a child engine, the ratio."""

from __future__ import annotations

import pytest

from refit_lab.bench import ipc
from refit_lab.bench.harness import BENCHES, BenchContext, BenchReport, load_bench
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios
from refit_lab.bench.references import MiB
from refit_lab.bench.relay import engine_config, state_bytes

TINY = ipc.Sizes(state_bytes=4 * MiB, buffer_bytes=MiB, repeats=2, hidden=128)

pytestmark = pytest.mark.timeout(300)


def test_ipc_is_registered() -> None:
    assert BENCHES["ipc"] == "refit_lab.bench.ipc:run"
    assert load_bench("ipc") is ipc.run


def test_states_have_the_promised_sizes() -> None:
    quick = state_bytes(engine_config(ipc.QUICK.state_bytes, hidden=ipc.QUICK.hidden))
    full = state_bytes(engine_config(ipc.FULL.state_bytes, hidden=ipc.FULL.hidden))
    assert 64 * MiB <= quick <= 70 * MiB
    assert 512 * MiB <= full <= 520 * MiB


def _gbps(case: str) -> Side:
    return Side("gbps", {"case": case})


RATIOS = {
    "ipc_fraction_of_memcpy": Ratio(_gbps("ipc"), _gbps("memcpy")),
    "ceiling_fraction_of_memcpy": Ratio(_gbps("copy_pipeline"), _gbps("memcpy")),
    "ipc_fraction_of_ceiling": Ratio(_gbps("ipc"), _gbps("copy_pipeline")),
}
"""Each summary ratio: the rows it compares, subject first."""


def test_refits_into_a_child_engine_bitexact_and_reports_the_ratio() -> None:
    report = ipc.measure(BenchContext(quick=True, threads=1), TINY)
    assert report.summary["bitexact"] is True
    assert [r["case"] for r in report.results] == ["memcpy", "copy_pipeline", "ipc"]
    check_summary_ratios(report, RATIOS)
    assert report.to_json()["bench"] == "ipc"


def test_summary_ratios_follow_the_rows() -> None:
    rows = [
        ipc.result_row("memcpy", 100, [1.0, 2.0, 4.0]),
        ipc.result_row("copy_pipeline", 100, [2.0, 8.0, 8.0]),
        ipc.result_row("ipc", 100, [4.0, 8.0, 4.0]),
    ]
    summary = ipc.summarize(rows)
    assert summary["ipc_fraction_of_memcpy"] == pytest.approx(0.25)
    assert summary["ceiling_fraction_of_memcpy"] == pytest.approx(0.5)
    assert summary["ipc_fraction_of_ceiling"] == pytest.approx(1.0)
    report = BenchReport(bench="ipc", quick=True, machine={}, results=rows, summary=summary)
    check_summary_ratios(report, RATIOS)
