"""`refit bench inflight_vllm` in its smallest form: one round per vLLM row on a real
``AsyncLLM``, every request complete."""

from __future__ import annotations

import pytest

from refit_lab.bench.harness import BENCHES, BenchContext
from refit_lab.bench.inflight_vllm import MODES, ROWS, STREAMS, Sizes, measure
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios
from refit_lab.reference_engine import ReferenceModelConfig

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

TINY = Sizes(
    ReferenceModelConfig(
        vocab_size=1024,
        hidden_size=128,
        num_layers=2,
        num_heads=2,  # head_dim 64 (vLLM's CPU attention refuses 16 and 32 is slow to build)
        num_kv_heads=2,
        intermediate_size=256,
        max_seq_len=256,
    ),
    rounds=1,
    quiet_s=0.3,
)


def _staged_over(row: str, key: str, reference_mode: str, reference_key: str) -> Ratio:
    return Ratio(
        Side(key, {"row": row, "mode": "staged"}),
        Side(reference_key, {"row": row, "mode": reference_mode}),
    )


SUMMARY_RATIOS = {
    **{
        f"{row}_pause_fraction_of_stop_the_world": _staged_over(
            row, "pause_ms", "stop_the_world", "pause_ms"
        )
        for row in ROWS
    },
    **{
        f"{row}_token_gap_fraction_of_stop_the_world": _staged_over(
            row, "token_gap_ms", "stop_the_world", "token_gap_ms"
        )
        for row in ROWS
    },
    **{
        f"{row}_tokens_during_staging_fraction": _staged_over(
            row, "moving_tokens_per_s", "staged", "quiet_tokens_per_s"
        )
        for row in ROWS
    },
}
"""Each summary ratio: the rows (one per row, round and mode) it compares, subject first."""


def test_one_round_per_row_loses_no_request() -> None:
    assert BENCHES["inflight_vllm"] == "refit_lab.bench.inflight_vllm:run"
    report = measure(BenchContext(quick=True, threads=1), TINY)
    cases = [r["case"] for r in report.results]
    assert cases == [f"{row} round 1 {mode}" for row in ROWS for mode in MODES]
    assert report.summary["requests_lost"] == 0
    assert report.summary["requests_submitted"] >= STREAMS
    for row in ROWS:
        assert report.summary[f"{row}_staged_pause_ms"] > 0
        assert report.summary[f"{row}_stop_the_world_pause_ms"] > 0
    check_summary_ratios(
        report,
        SUMMARY_RATIOS,
        other_keys={
            "requests_submitted",
            "requests_lost",
            *(f"{row}_{mode}_pause_ms" for row in ROWS for mode in MODES),
        },
    )
    report.to_json()
