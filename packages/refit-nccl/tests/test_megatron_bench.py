"""``refit bench megatron --quick``: every layout change bitwise, bytes at the lower bound."""

from __future__ import annotations

import pytest

from refit_lab.bench.harness import BenchContext, load_bench


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_is_bitexact_and_sends_the_lower_bound() -> None:
    report = load_bench("megatron")(BenchContext(quick=True, threads=2))
    assert report.summary["bitexact"] is True
    assert report.summary["bytes_vs_lower_bound"] == 1.0
    assert 0 < report.summary["bytes_fraction_of_naive"] <= 1.0
    assert report.summary["time_vs_flat_broadcast"] > 0
    assert report.summary["time_vs_flat_broadcast_reference_gbps"] > 0
    assert {r["case"] for r in report.results} >= {"tp2->1", "tp1->2", "tp4->2", "pp2->1"}
