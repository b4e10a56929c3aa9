"""``refit bench megatron --quick``: every layout change bitwise, bytes at the lower bound, the
time ratio its rows'."""

from __future__ import annotations

import pytest

from refit_lab.bench.harness import BenchContext, load_bench
from refit_lab.bench.ratio_check import Ratio, Side, Worst, check_summary_ratios

CHANGES = ("tp2->1", "tp1->2", "tp4->2", "pp2->1")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_is_bitexact_and_sends_the_lower_bound() -> None:
    report = load_bench("megatron")(BenchContext(quick=True, threads=2))
    assert report.summary["bitexact"] is True
    assert report.summary["bytes_vs_lower_bound"] == 1.0
    assert 0 < report.summary["bytes_fraction_of_naive"] <= 1.0
    assert {r["case"] for r in report.results} >= set(CHANGES)
    cases = [str(r["case"]) for r in report.results]  # the summary's worst is over all of them
    reshard_time_vs_flat = Worst(
        [
            Ratio(Side("gbps", {"case": c}), Side("flat_gbps", {"case": c}), time=True)
            for c in cases
        ],
        pick="highest",
    )
    check_summary_ratios(
        report,
        {"time_vs_flat_broadcast": reshard_time_vs_flat},
        other_keys={"bytes_vs_lower_bound", "bytes_fraction_of_naive"},
    )
