"""`refit bench scale` in its smallest form (two tiny tied models, one round per row): every
refit reproduces a fresh engine, and every summary number follows from the bench's own rows."""

from __future__ import annotations

import statistics

import pytest

from refit_lab.bench.harness import BENCHES, BenchContext
from refit_lab.bench.scale import QUICK, ROWS, measure

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


def test_quick_run_is_exact_and_its_summary_follows_from_its_rows() -> None:
    assert BENCHES["scale"] == "refit_lab.bench.scale:run"
    report = measure(BenchContext(quick=True, threads=1), QUICK)
    rows, summary = report.results, report.summary
    assert summary["exact"] is True
    assert {(r["model"], r["row"]) for r in rows} == {
        (model, row) for model in ("small", "large") for row in ROWS
    }

    def pick(model: str, row: str, kind: str | None = None) -> list[dict[str, object]]:
        return [
            r for r in rows if (r["model"], r["row"]) == (model, row) and kind in (None, r["kind"])
        ]

    def over_reload(chosen: list[dict[str, object]]) -> float:
        return statistics.median(float(r["seconds"]) / float(r["disk_reload_s"]) for r in chosen)

    def per_byte(model: str, row: str) -> float:
        dense = pick(model, row, "dense")
        seconds = statistics.median(float(r["seconds"]) for r in dense)
        return seconds / int(dense[0]["model_bytes"])

    expected: dict[str, float] = {}
    for row in ROWS:
        large = pick("large", row)
        nbytes = int(large[0]["model_bytes"])
        expected[f"{row}_dense_over_disk_reload"] = over_reload(pick("large", row, "dense"))
        expected[f"{row}_large_over_small_per_byte"] = per_byte("large", row) / per_byte(
            "small", row
        )
        for what in ("kept", "peak"):
            expected[f"{row}_engine_extra_memory_{what}_over_model"] = (
                max(int(r[f"engine_{what}_extra_bytes"]) for r in large) / nbytes
            )
        expected[f"{row}_trainer_extra_memory_over_model"] = (
            max(int(r["trainer_peak_extra_bytes"]) for r in large) / nbytes
        )
    deltas = pick("large", "zmq_sparse", "delta")
    assert [r["kind"] for r in pick("large", "zmq_sparse")] == ["dense", "delta", "delta"]
    expected["zmq_sparse_delta_over_disk_reload"] = over_reload(deltas)
    expected["zmq_sparse_first_delta_extra_s"] = float(deltas[0]["seconds"]) - float(
        deltas[1]["seconds"]
    )
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value, rel=1e-9), key
    assert all(float(r["seconds"]) > 0 and float(r["disk_reload_s"]) > 0 for r in rows)
    report.to_json()
