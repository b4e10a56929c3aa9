"""The `inflight` bench in its smallest form: two engines on a local Ray cluster, one round."""

from __future__ import annotations

import pytest

from refit_lab.bench import inflight
from refit_lab.bench.harness import BENCHES, BenchContext, load_bench
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios
from refit_lab.reference_engine import GenerationOutput, ReferenceModelConfig, WeightVersionSpan
from refit_lab.serving_load import CLIENTS_PER_ENGINE, NEW_TOKENS, complete

MiB = 1 << 20
TINY = inflight.Sizes(
    engines=2,
    config=ReferenceModelConfig(vocab_size=512, hidden_size=128, num_layers=2, max_seq_len=32),
    rounds=1,
    quiet_s=0.3,
)
SUMMARY_RATIOS = {
    "pause_fraction_of_stop_the_world": Ratio(
        Side("pause_ms", {"mode": "staged"}), Side("pause_ms", {"mode": "stop_the_world"})
    ),
    "token_gap_fraction_of_stop_the_world": Ratio(
        Side("token_gap_ms", {"mode": "staged"}), Side("token_gap_ms", {"mode": "stop_the_world"})
    ),
    "tokens_during_staging_fraction": Ratio(
        Side("moving_tokens_per_s", {"mode": "staged"}),
        Side("quiet_tokens_per_s", {"mode": "staged"}),
    ),
}
"""Each summary ratio: the rows (one per round and mode) it compares, subject first."""
SUMMARY_KEYS = {
    "pause_fraction_of_stop_the_world",
    "staged_pause_ms",
    "stop_the_world_pause_ms",
    "token_gap_fraction_of_stop_the_world",
    "staged_token_gap_ms",
    "stop_the_world_token_gap_ms",
    "tokens_during_staging_fraction",
    "staging_tokens_per_s",
    "no_refit_tokens_per_s",
    "requests_submitted",
    "requests_lost",
    "bitexact",
}


def test_inflight_is_registered() -> None:
    assert BENCHES["inflight"] == "refit_lab.bench.inflight:run"
    assert load_bench("inflight") is inflight.run


def test_models_move_enough_bytes() -> None:
    assert 90 * MiB <= inflight.state_bytes(inflight.QUICK.config) <= 100 * MiB
    assert inflight.state_bytes(inflight.FULL.config) >= 256 * MiB


def test_an_output_is_complete_only_when_its_spans_cover_every_token() -> None:
    def output(tokens: int, spans: list[WeightVersionSpan]) -> GenerationOutput:
        return GenerationOutput([[0] * tokens], 2, [spans])

    n = NEW_TOKENS
    assert complete(output(n, [WeightVersionSpan(1, 0, 3), WeightVersionSpan(2, 3, n)]), n)
    assert not complete(output(n - 1, [WeightVersionSpan(1, 0, n - 1)]), n)
    assert not complete(output(n, [WeightVersionSpan(1, 0, 3)]), n)
    assert not complete(output(n, [WeightVersionSpan(1, 1, n)]), n)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_run_loses_no_request_and_is_bitexact() -> None:
    pytest.importorskip("ray", reason="ray (dev group) is not installed")
    report = inflight.measure(BenchContext(quick=True, threads=1), TINY)
    assert set(report.summary) == SUMMARY_KEYS
    assert report.summary["requests_lost"] == 0
    assert report.summary["requests_submitted"] >= 2 * CLIENTS_PER_ENGINE
    assert report.summary["bitexact"] is True
    assert [r["case"] for r in report.results] == ["round 1 staged", "round 1 stop_the_world"]
    assert all(r["bitexact"] is True for r in report.results)
    assert report.summary["stop_the_world_pause_ms"] > 0
    check_summary_ratios(report, SUMMARY_RATIOS, other_keys=SUMMARY_KEYS - SUMMARY_RATIOS.keys())
    report.to_json()
