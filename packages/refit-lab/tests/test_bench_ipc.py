"""The `ipc` bench at a tiny size: registration, a bit-exact refit into a child engine, the ratio."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from refit_lab.bench import ipc
from refit_lab.bench.harness import BENCHES, BenchContext, load_bench
from refit_lab.bench.references import MiB
from refit_lab.bench.relay import engine_config, state_bytes

TINY = ipc.Sizes(state_bytes=4 * MiB, buffer_bytes=MiB, repeats=1, hidden=128)

pytestmark = pytest.mark.timeout(300)


def test_ipc_is_registered() -> None:
    assert BENCHES["ipc"] == "refit_lab.bench.ipc:run"
    assert load_bench("ipc") is ipc.run


def test_states_have_the_promised_sizes() -> None:
    quick = state_bytes(engine_config(ipc.QUICK.state_bytes, hidden=ipc.QUICK.hidden))
    full = state_bytes(engine_config(ipc.FULL.state_bytes, hidden=ipc.FULL.hidden))
    assert 64 * MiB <= quick <= 70 * MiB
    assert 512 * MiB <= full <= 520 * MiB


def test_refits_into_a_child_engine_bitexact_and_reports_the_ratio() -> None:
    report = ipc.measure(BenchContext(quick=True, threads=1), TINY)
    assert report.summary["bitexact"] is True
    assert report.summary["ipc_fraction_of_memcpy"] > 0
    assert report.summary["ipc_fraction_of_memcpy_reference_gbps"] > 0
    assert [r["case"] for r in report.results] == ["memcpy", "copy_pipeline", "ipc"]
    assert report.to_json()["bench"] == "ipc"
    _check_ratios_against_rows(report.summary, report.results)


RATIOS = {
    "ipc_fraction_of_memcpy": ("ipc", "memcpy"),
    "ceiling_fraction_of_memcpy": ("copy_pipeline", "memcpy"),
    "ipc_fraction_of_ceiling": ("ipc", "copy_pipeline"),
}


def _check_ratios_against_rows(summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Every summary ratio is the median over rounds of the subject's rate over the
    reference's, recomputed here from the rows' own per-round seconds and bytes."""
    by_case = {row["case"]: row for row in rows}
    ratios = {k for k in summary if k != "bitexact" and not k.endswith("_reference_gbps")}
    assert ratios == set(RATIOS)
    for key, (subject, reference) in RATIOS.items():
        a, b = by_case[subject], by_case[reference]
        per_round = [
            (a["nbytes"] / sa) / (b["nbytes"] / sb)
            for sa, sb in zip(a["round_s"], b["round_s"], strict=True)
        ]
        assert summary[key] == pytest.approx(statistics.median(per_round), rel=1e-12)
        median_rate = statistics.median(b["nbytes"] / s / 1e9 for s in b["round_s"])
        assert summary[f"{key}_reference_gbps"] == pytest.approx(median_rate, rel=1e-12)


def test_summary_ratios_follow_the_rows() -> None:
    rows = [
        {"case": "memcpy", "nbytes": 100, "round_s": [1.0, 2.0, 4.0]},
        {"case": "copy_pipeline", "nbytes": 100, "round_s": [2.0, 8.0, 8.0]},
        {"case": "ipc", "nbytes": 100, "round_s": [4.0, 8.0, 4.0]},
    ]
    summary = ipc.summarize(rows)  # type: ignore[arg-type]
    assert summary["ipc_fraction_of_memcpy"] == pytest.approx(0.25)
    assert summary["ceiling_fraction_of_memcpy"] == pytest.approx(0.5)
    assert summary["ipc_fraction_of_ceiling"] == pytest.approx(1.0)
    _check_ratios_against_rows(summary, rows)
