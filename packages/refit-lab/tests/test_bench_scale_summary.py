"""`refit bench scale`'s summary over two models: the cost growth of each row, large over small
per byte, follows from the rows (the engine tier's test runs one model and checks the rest)."""

from __future__ import annotations

import random

from refit_lab.bench.harness import BenchReport
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios
from refit_lab.bench.scale import ROWS, summarize


def _rows() -> list[dict[str, object]]:
    """Rows of a run of three rounds: refit seconds drawn at random, the small model a fifth
    of the large one's bytes."""
    draw = random.Random(5)
    rows: list[dict[str, object]] = []
    for model, nbytes in (("small", 200_000), ("large", 1_000_000)):
        for row in ROWS:
            for round_ in (1, 2, 3):
                for kind in ("dense", "delta", "delta"):
                    seconds = draw.uniform(0.5, 2.0)
                    rows.append(
                        {
                            "case": f"{model} {row} {kind} {round_} {len(rows)}",
                            "model": model,
                            "row": row,
                            "kind": kind,
                            "model_bytes": nbytes,
                            "seconds": seconds,
                            "seconds_per_byte": seconds / nbytes,
                            "disk_reload_s": draw.uniform(0.5, 2.0),
                            "disk_write_s": 0.5,
                            "disk_write_and_reload_s": 1.0,
                            "engine_kept_extra_bytes": nbytes,
                            "engine_peak_extra_bytes": nbytes,
                            "trainer_peak_extra_bytes": nbytes,
                            "exact": True,
                        }
                    )
    return rows


def test_growth_per_byte_pairs_each_rounds_large_refit_with_the_small_ones() -> None:
    rows = _rows()
    summary = summarize(rows, True, ["small", "large"])
    report = BenchReport("scale", True, {}, rows, summary)
    growth = {
        f"{row}_large_over_small_per_byte": Ratio(
            Side("seconds_per_byte", {"model": "large", "row": row, "kind": "dense"}),
            Side("seconds_per_byte", {"model": "small", "row": row, "kind": "dense"}),
        )
        for row in ROWS
    }
    others = [key for key in summary if key not in growth]
    check_summary_ratios(report, growth, other_keys=others)
    assert summary.keys() >= growth.keys()
