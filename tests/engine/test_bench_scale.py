"""`refit bench scale` in its smallest form (one tiny tied model, one round per row: five engine
starts): every refit reproduces a fresh engine, and every summary number follows from the
bench's own rows (the growth over a smaller model needs two, which `refit bench scale --quick`
runs)."""

from __future__ import annotations

import statistics

import pytest

from refit_lab.bench.harness import BENCHES, BenchContext
from refit_lab.bench.ratio_check import Ratio, Side, Worst, check_summary_ratios
from refit_lab.bench.scale import ROWS, Sizes, measure
from refit_lab.bench.scale_models import QUICK_MODELS

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


MODEL = QUICK_MODELS[0]


def _rows_of(row: str, kind: str | None = None) -> dict[str, object]:
    where: dict[str, object] = {"model": MODEL.name, "row": row}
    return where if kind is None else {**where, "kind": kind}


def test_quick_run_is_exact_and_its_summary_follows_from_its_rows() -> None:
    assert BENCHES["scale"] == "refit_lab.bench.scale:run"
    report = measure(BenchContext(quick=True, threads=1), Sizes((MODEL,), rounds=1))
    rows, summary = report.results, report.summary
    assert summary["exact"] is True
    for row in ROWS:
        cases = [str(r["case"]) for r in rows if r["row"] == row]
        steps = ("dense 1 to B", "delta 1 to B1", "delta 1 to B")
        assert cases == [f"{MODEL.name} {row} {step}" for step in steps]

    ratios: dict[str, Ratio | Worst] = {}
    for row in ROWS:
        for kind in ("dense", "delta"):
            ratios[f"{row}_{kind}_over_disk_reload"] = Ratio(
                Side("seconds", _rows_of(row, kind)), Side("disk_reload_s", _rows_of(row, kind))
            )
        ratios[f"{row}_dense_over_disk_write_and_reload"] = Ratio(
            Side("seconds", _rows_of(row, "dense")),
            Side("disk_write_and_reload_s", _rows_of(row, "dense")),
        )
        cases = [str(r["case"]) for r in rows if r["row"] == row]
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

    deltas = [float(r["seconds"]) for r in rows if (r["row"], r["kind"]) == ("zmq_sparse", "delta")]
    assert summary["zmq_sparse_first_delta_extra_s"] == pytest.approx(deltas[0] - deltas[1])
    for field in ("disk_reload_s", "disk_write_s"):
        assert summary[field] == pytest.approx(statistics.median(float(r[field]) for r in rows))
    for r in rows:
        assert float(r["seconds"]) > 0 and float(r["disk_reload_s"]) > 0, r
        assert float(r["engine_check_s"]) > 0, r
    report.to_json()
