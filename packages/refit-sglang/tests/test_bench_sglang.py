"""``refit bench sglang --quick`` runs and reports its summary keys (no timed assertion)."""

from __future__ import annotations

import pytest

from refit_lab.bench.harness import BenchContext, load_bench


@pytest.mark.timeout(120)
def test_quick_bench_is_bitexact() -> None:
    report = load_bench("sglang")(BenchContext(quick=True, progress=lambda *_: None))
    assert report.summary["bitexact"] is True
    assert report.summary["bucket_speedup_vs_per_tensor"] > 0
    assert {r["case"] for r in report.results} == {"memcpy", "flattened", "per_tensor"}
