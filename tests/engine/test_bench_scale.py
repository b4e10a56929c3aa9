"""`refit bench scale` in its smallest form (two tiny tied models, one round per row): every
refit reproduces a fresh engine, and every summary number follows from the bench's own rows."""

from __future__ import annotations

import statistics

import pytest

from refit_lab.bench.harness import BENCHES, BenchContext
from refit_lab.bench.ratio_check import Ratio, Side, Worst, check_summary_ratios
from refit_lab.bench.scale import QUICK, ROWS, measure

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


def _large(row: str, kind: str | None = None) -> dict[str, object]:
    where: dict[str, object] = {"model": "large", "row": row}
    return where if kind is None else {**where, "kind": kind}


def test_quick_run_is_exact_and_its_summary_follows_from_its_rows() -> None:
    assert BENCHES["scale"] == "refit_lab.bench.scale:run"
    report = measure(BenchContext(quick=True, threads=1), QUICK)
    rows, summary = report.results, report.summary
    assert summary["exact"] is True
    for model in ("small", "large"):
        for row in ROWS:
            cases = [str(r["case"]) for r in rows if (r["model"], r["row"]) == (model, row)]
            steps = ("dense 1 to B", "delta 1 to B1", "delta 1 to B")
            assert cases == [f"{model} {row} {step}" for step in steps]

    ratios: dict[str, Ratio | Worst] = {}
    for row in ROWS:
        for kind in ("dense", "delta"):
            ratios[f"{row}_{kind}_over_disk_reload"] = Ratio(
                Side("seconds", _large(row, kind)), Side("disk_reload_s", _large(row, kind))
            )
        ratios[f"{row}_dense_over_disk_write_and_reload"] = Ratio(
            Side("seconds", _large(row, "dense")),
            Side("disk_write_and_reload_s", _large(row, "dense")),
        )
        ratios[f"{row}_large_over_small_per_byte"] = Ratio(
            Side("seconds_per_byte", _large(row, "dense")),
            Side("seconds_per_byte", {"model": "small", "row": row, "kind": "dense"}),
        )
        cases = [str(r["case"]) for r in rows if r["model"] == "large" and r["row"] == row]
        for field, key in (
            ("engine_kept_extra_bytes", "engine_extra_memory_kept_over_model"),
            ("engine_peak_extra_bytes", "engine_extra_memory_peak_over_model"),
            ("trainer_peak_extra_bytes", "trainer_extra_memory_over_model"),
        ):
            ratios[f"{row}_{key}"] = Worst(
                [
                    Ratio(Side(field, {"case": case}), Side("model_bytes", {"case": case}))
                    for case in cases
                ],
                pick="highest",
            )
    others = ("zmq_sparse_first_delta_extra_s", "disk_reload_s", "disk_write_s")
    check_summary_ratios(report, ratios, other_keys=others)

    large = [r for r in rows if r["model"] == "large"]
    deltas = [
        float(r["seconds"]) for r in large if (r["row"], r["kind"]) == ("zmq_sparse", "delta")
    ]
    assert summary["zmq_sparse_first_delta_extra_s"] == pytest.approx(deltas[0] - deltas[1])
    for field in ("disk_reload_s", "disk_write_s"):
        assert summary[field] == pytest.approx(statistics.median(float(r[field]) for r in large))
    for r in rows:
        assert float(r["seconds"]) > 0 and float(r["disk_reload_s"]) > 0, r
        assert float(r["engine_check_s"]) > 0, r
    report.to_json()
