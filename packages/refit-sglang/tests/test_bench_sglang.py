"""``refit bench sglang --quick`` runs, bit-exact, and its summary ratio is its rows' (no timed
assertion)."""

from __future__ import annotations

import pytest

from refit_lab.bench.harness import BenchContext, load_bench
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios


@pytest.mark.timeout(120)
def test_quick_bench_is_bitexact() -> None:
    report = load_bench("sglang")(BenchContext(quick=True, progress=lambda *_: None))
    assert report.summary["bitexact"] is True
    assert {r["case"] for r in report.results} == {"memcpy", "flattened", "per_tensor"}
    flattened_vs_per_tensor = Ratio(
        Side("gbps", {"case": "flattened"}), Side("gbps", {"case": "per_tensor"})
    )
    check_summary_ratios(report, {"bucket_speedup_vs_per_tensor": flattened_vs_per_tensor})
