"""Tests of the reference engine: determinism, refit semantics, fused layout, validation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from refit_lab.digest import tensor_digest
from refit_lab.reference_engine import (
    GenerationOutput,
    ReferenceEngine,
    ReferenceModelConfig,
    WeightVersionSpan,
    checkpoint_tensor_specs,
    random_checkpoint,
)
from refit_lab.serving_gate import EngineClosedError, GateState

CONFIG = ReferenceModelConfig()
PROMPTS = [[1, 2, 3, 4, 5, 6], [10, 20, 30, 40], [7, 7, 7, 7, 7, 7, 7, 7], [100, 101, 102, 103]]
NEW_TOKENS = 8
SEED_A = 1
SEED_B = 2


@pytest.fixture(scope="module")
def checkpoint_b() -> dict[str, torch.Tensor]:
    return random_checkpoint(CONFIG, SEED_B)


@pytest.fixture(scope="module")
def fresh_b_tokens() -> list[list[int]]:
    return ReferenceEngine(CONFIG, seed=SEED_B).generate(PROMPTS, NEW_TOKENS).tokens


# --- config and checkpoint ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"max_seq_len": True}, "max_seq_len"),
        ({"hidden_size": 66}, "num_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}, "head_dim"),
        ({"dtype": "float64"}, "dtype"),
        ({"dtype": "torch.bfloat16"}, "dtype"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReferenceModelConfig(**kwargs)  # type: ignore[arg-type]


def test_checkpoint_specs_match_random_checkpoint() -> None:
    specs = checkpoint_tensor_specs(CONFIG)
    checkpoint = random_checkpoint(CONFIG, 0)
    assert list(checkpoint) == list(specs)
    assert len(specs) == 3 + 9 * CONFIG.num_layers
    for name, (shape, dtype) in specs.items():
        assert tuple(checkpoint[name].shape) == shape
        assert str(checkpoint[name].dtype) == f"torch.{dtype}"
    head_dim = CONFIG.head_dim
    assert specs["model.layers.1.self_attn.q_proj.weight"][0] == (
        CONFIG.num_heads * head_dim,
        CONFIG.hidden_size,
    )
    assert specs["model.layers.1.self_attn.k_proj.weight"][0] == (
        CONFIG.num_kv_heads * head_dim,
        CONFIG.hidden_size,
    )
    assert "lm_head.weight" in specs
    assert "model.embed_tokens.weight" in specs


def test_random_checkpoint_is_deterministic() -> None:
    first, second = random_checkpoint(CONFIG, 5), random_checkpoint(CONFIG, 5)
    other = random_checkpoint(CONFIG, 6)
    for name in first:
        assert tensor_digest(first[name]) == tensor_digest(second[name])
        assert tensor_digest(first[name]) != tensor_digest(other[name])


def test_engine_specs_match_module_function() -> None:
    assert ReferenceEngine(CONFIG).checkpoint_tensor_specs() == checkpoint_tensor_specs(CONFIG)


# --- determinism -------------------------------------------------------------------------


def test_same_checkpoint_gives_same_tokens_and_digests() -> None:
    first, second = ReferenceEngine(CONFIG, seed=SEED_A), ReferenceEngine(CONFIG, seed=SEED_A)
    assert first.generate(PROMPTS, NEW_TOKENS) == second.generate(PROMPTS, NEW_TOKENS)
    assert first.state_digests() == second.state_digests()
    assert first.combined_digest() == second.combined_digest()


def test_different_seeds_give_different_tokens_and_digests() -> None:
    first, second = ReferenceEngine(CONFIG, seed=SEED_A), ReferenceEngine(CONFIG, seed=SEED_B)
    first_tokens = first.generate(PROMPTS, NEW_TOKENS).tokens
    second_tokens = second.generate(PROMPTS, NEW_TOKENS).tokens
    for ours, theirs in zip(first_tokens, second_tokens, strict=True):
        assert ours != theirs
    first_digests, second_digests = first.state_digests(), second.state_digests()
    assert all(first_digests[name] != second_digests[name] for name in first_digests)
    assert first.combined_digest() != second.combined_digest()


def test_generation_is_not_degenerate() -> None:
    tokens = ReferenceEngine(CONFIG, seed=SEED_A).generate(PROMPTS, NEW_TOKENS).tokens
    assert all(len(row) == NEW_TOKENS for row in tokens)
    assert all(len(set(row)) > 1 for row in tokens)
    assert len({tuple(row) for row in tokens}) == len(PROMPTS)


def test_prefix_cache_hit_reproduces_miss() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    cold = engine.generate(PROMPTS, NEW_TOKENS)
    warm = engine.generate(PROMPTS, NEW_TOKENS)
    assert warm == cold
    stats = engine.prefix_cache_stats()
    assert (stats.hits, stats.misses) == (len(PROMPTS), len(PROMPTS))
    assert stats.hit_tokens == sum(len(prompt) - 1 for prompt in PROMPTS)


def test_partial_prefix_hit_reproduces_cold_engine() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    engine.generate([[1, 2, 3]], 2)
    extended = [[1, 2, 3, 9, 8]]
    warm = engine.generate(extended, NEW_TOKENS)
    stats = engine.prefix_cache_stats()
    assert stats.hits == 1
    assert stats.hit_tokens == 3
    assert warm == ReferenceEngine(CONFIG, seed=SEED_A).generate(extended, NEW_TOKENS)


def test_prefix_cache_is_bounded_lru() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A, max_prefix_cache_entries=2)
    engine.generate([[1, 2], [3, 4]], 1)
    engine.generate([[1, 2]], 1)  # refreshes [1, 2]
    engine.generate([[5, 6]], 1)  # evicts [3, 4]
    assert engine.prefix_cache_stats().entries == 2
    before = engine.prefix_cache_stats()
    engine.generate([[1, 2]], 1)
    engine.generate([[3, 4]], 1)
    after = engine.prefix_cache_stats()
    assert after.hits - before.hits == 1
    assert after.misses - before.misses == 1


def test_prefix_cache_can_be_disabled() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A, max_prefix_cache_entries=0)
    engine.generate(PROMPTS, 2)
    engine.generate(PROMPTS, 2)
    stats = engine.prefix_cache_stats()
    assert (stats.hits, stats.entries) == (0, 0)


def test_incremental_decoding_matches_full_forward() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    ids = torch.tensor([[5, 9, 2, 44, 7, 3]])
    with torch.no_grad():
        full, _ = engine.model(ids)
        prefix_logits, past = engine.model(ids[:, :4])
        rest_logits, present = engine.model(ids[:, 4:], past)
    assert present[0][0].shape == (1, CONFIG.num_kv_heads, 6, CONFIG.head_dim)
    incremental = torch.cat((prefix_logits, rest_logits), dim=1)
    assert torch.allclose(incremental, full, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(incremental[:, -1], full[:, 0], rtol=1e-4, atol=1e-4)


# --- refit semantics ---------------------------------------------------------------------


def test_load_weights_matches_fresh_engine_after_reset(
    checkpoint_b: dict[str, torch.Tensor], fresh_b_tokens: list[list[int]]
) -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    engine.generate(PROMPTS, NEW_TOKENS)
    loaded = engine.load_weights(checkpoint_b.items())
    assert loaded == set(checkpoint_b)
    fresh = ReferenceEngine(CONFIG, seed=SEED_B)
    assert engine.state_digests() == fresh.state_digests()
    assert engine.combined_digest() == fresh.combined_digest()
    engine.reset_prefix_cache()
    assert engine.prefix_cache_stats().entries == 0
    assert engine.prefix_cache_stats().resets == 1
    assert engine.generate(PROMPTS, NEW_TOKENS).tokens == fresh_b_tokens


def test_forgotten_reset_serves_stale_kv(
    checkpoint_b: dict[str, torch.Tensor], fresh_b_tokens: list[list[int]]
) -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    engine.generate(PROMPTS, NEW_TOKENS)
    engine.load_weights(checkpoint_b.items())
    before = engine.prefix_cache_stats()
    stale = engine.generate(PROMPTS, NEW_TOKENS).tokens
    after = engine.prefix_cache_stats()
    assert after.hits - before.hits == len(PROMPTS)  # every prompt reused old-weight KV
    assert engine.combined_digest() == ReferenceEngine(CONFIG, seed=SEED_B).combined_digest()
    for stale_row, fresh_row in zip(stale, fresh_b_tokens, strict=True):
        assert stale_row != fresh_row


def test_load_weights_accepts_partial_and_streamed_updates(
    checkpoint_b: dict[str, torch.Tensor],
) -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    digests_a = engine.state_digests()
    name = "model.layers.0.self_attn.k_proj.weight"
    assert engine.load_weights(iter([(name, checkpoint_b[name])])) == {name}
    digests = engine.state_digests()
    assert digests[name] == tensor_digest(checkpoint_b[name])
    assert {n: d for n, d in digests.items() if n != name} == {
        n: d for n, d in digests_a.items() if n != name
    }


# --- fused layout ------------------------------------------------------------------------


def test_fused_qkv_and_gate_up_layout(checkpoint_b: dict[str, torch.Tensor]) -> None:
    engine = ReferenceEngine(CONFIG)
    engine.load_weights(checkpoint_b.items())
    params = dict(engine.model.named_parameters())
    q_rows = CONFIG.num_heads * CONFIG.head_dim
    kv_rows = CONFIG.num_kv_heads * CONFIG.head_dim
    inter = CONFIG.intermediate_size
    assert not any(".q_proj." in name or ".gate_proj." in name for name in params)
    for i in range(CONFIG.num_layers):
        prefix = f"model.layers.{i}"
        qkv = params[f"{prefix}.self_attn.qkv_proj.weight"]
        assert qkv.shape == (q_rows + 2 * kv_rows, CONFIG.hidden_size)
        assert torch.equal(qkv[:q_rows], checkpoint_b[f"{prefix}.self_attn.q_proj.weight"])
        assert torch.equal(
            qkv[q_rows : q_rows + kv_rows], checkpoint_b[f"{prefix}.self_attn.k_proj.weight"]
        )
        assert torch.equal(
            qkv[q_rows + kv_rows :], checkpoint_b[f"{prefix}.self_attn.v_proj.weight"]
        )
        gate_up = params[f"{prefix}.mlp.gate_up_proj.weight"]
        assert gate_up.shape == (2 * inter, CONFIG.hidden_size)
        assert torch.equal(gate_up[:inter], checkpoint_b[f"{prefix}.mlp.gate_proj.weight"])
        assert torch.equal(gate_up[inter:], checkpoint_b[f"{prefix}.mlp.up_proj.weight"])
    assert torch.equal(params["lm_head.weight"], checkpoint_b["lm_head.weight"])


def test_checkpoint_tensors_are_views_of_live_params(
    checkpoint_b: dict[str, torch.Tensor],
) -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_B)
    tensors = engine.checkpoint_tensors()
    assert set(tensors) == set(checkpoint_b)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, checkpoint_b[name])
    qkv = dict(engine.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    v_view = tensors["model.layers.0.self_attn.v_proj.weight"]
    assert v_view.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    before = engine.combined_digest()
    with torch.no_grad():
        v_view[0, 0] += 1.0
    assert engine.combined_digest() != before
    assert torch.equal(qkv[-v_view.shape[0] :], v_view)


# --- validation --------------------------------------------------------------------------


def test_unknown_name_raises_key_error_and_leaves_weights() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    before = engine.state_digests()
    bogus = "model.layers.0.self_attn.qkv_proj.weight"  # the fused name is not a checkpoint name
    with pytest.raises(KeyError, match="qkv_proj"):
        engine.load_weights([(bogus, torch.zeros(128, 64, dtype=torch.bfloat16))])
    assert engine.state_digests() == before


def test_wrong_shape_raises_value_error_and_leaves_weights() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    before = engine.state_digests()
    name = "model.layers.1.self_attn.k_proj.weight"
    wrong = torch.zeros(CONFIG.num_heads * CONFIG.head_dim, CONFIG.hidden_size).bfloat16()
    with pytest.raises(ValueError, match="k_proj"):
        engine.load_weights([(name, wrong)])
    assert engine.state_digests() == before


def test_wrong_dtype_raises_value_error_and_leaves_weights(
    checkpoint_b: dict[str, torch.Tensor],
) -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    before = engine.state_digests()
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="up_proj"):
        engine.load_weights([(name, checkpoint_b[name].float())])
    assert engine.state_digests() == before


def test_generate_validates_prompts() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[CONFIG.vocab_size]], 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[1] * CONFIG.max_seq_len], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], -1)
    assert engine.generate([[1, 2]], 0).tokens == [[]]


# --- weight version ----------------------------------------------------------------------


def test_weight_version_is_monotonic_and_reported() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    assert engine.weight_version == 0
    assert engine.generate(PROMPTS[:1], 1).weight_version == 0
    engine.set_weight_version(3)
    assert engine.weight_version == 3
    with pytest.raises(ValueError, match="must increase"):
        engine.set_weight_version(3)
    with pytest.raises(ValueError, match="must increase"):
        engine.set_weight_version(2)
    assert engine.weight_version == 3
    output = engine.generate(PROMPTS[:1], 1)
    assert isinstance(output, GenerationOutput)
    assert output.weight_version == 3


def test_refit_notifications_gate_generation() -> None:
    engine = ReferenceEngine(ReferenceModelConfig(), seed=1)
    prompts = [[1, 2, 3]]
    before = engine.generate(prompts, 3).tokens
    engine.on_refit_begin(1)
    assert engine.serving_state is GateState.PAUSED
    with pytest.raises(EngineClosedError, match="paused"):
        engine.generate(prompts, 3)
    engine.on_refit_abort(1, weights_changed=False)
    assert engine.generate(prompts, 3).tokens == before
    engine.on_refit_begin(1)
    engine.on_refit_abort(1, weights_changed=True)
    with pytest.raises(EngineClosedError, match="closed: the refit to version 1 failed"):
        engine.generate(prompts, 3)
    engine.on_refit_commit(2)
    assert engine.generate(prompts, 3).tokens == before


def test_a_held_request_is_served_once_the_refit_commits() -> None:
    engine = ReferenceEngine(ReferenceModelConfig(), seed=1)
    engine.on_refit_begin(1)
    results: list[list[list[int]]] = []
    held = threading.Thread(
        target=lambda: results.append(engine.generate([[4, 5]], 2, wait_s=30).tokens)
    )
    held.start()
    time.sleep(0.2)
    assert not results, "a request was answered while the refit was writing"
    engine.on_refit_commit(1)
    held.join(10)
    assert results and len(results[0][0]) == 2


class _BeginsARefitMidRequest(ReferenceEngine):
    """Begins a refit itself once ``pause_at`` tokens were generated: a step boundary in the
    middle of a request, reached deterministically."""

    pause_at = 0

    def _advance(self, request: object, version: int) -> None:  # type: ignore[override]
        super()._advance(request, version)  # type: ignore[arg-type]
        if self.tokens_generated == self.pause_at:
            self.on_refit_begin(version + 1)


def test_a_request_in_flight_across_a_commit_is_held_then_finishes_on_the_new_weights(
    checkpoint_b: dict[str, torch.Tensor],
) -> None:
    """Paused after 3 of 8 tokens, a batch of two requests waits (no token while the weights
    are written), then finishes under version 1: one switch at token 3 per request, the tokens
    before it those of the old weights, those after it a fresh engine's on the new weights
    continuing the same prefix."""
    prompts, switch = PROMPTS[:2], 3
    engine = _BeginsARefitMidRequest(CONFIG, seed=SEED_A)
    engine.pause_at = switch * len(prompts)
    outputs: list[GenerationOutput] = []
    request = threading.Thread(target=lambda: outputs.append(engine.generate(prompts, NEW_TOKENS)))
    request.start()
    give_up = time.monotonic() + 30
    while engine.serving_state is not GateState.PAUSED:
        assert time.monotonic() < give_up and request.is_alive(), "the refit never began"
        time.sleep(0.005)
    engine.load_weights(checkpoint_b.items())
    engine.reset_prefix_cache()
    engine.set_weight_version(1)
    assert engine.tokens_generated == switch * len(prompts), "a token while writing weights"
    engine.on_refit_commit(1)
    request.join(30)
    assert outputs, "the request in flight was lost"
    (output,) = outputs
    old = ReferenceEngine(CONFIG, seed=SEED_A).generate(prompts, NEW_TOKENS).tokens
    fresh_b = ReferenceEngine(CONFIG, seed=SEED_B)
    assert output.weight_version == 1
    for prompt, tokens, spans, old_tokens in zip(
        prompts, output.tokens, output.weight_versions, old, strict=True
    ):
        assert spans == [WeightVersionSpan(0, 0, switch), WeightVersionSpan(1, switch, NEW_TOKENS)]
        assert tokens[:switch] == old_tokens[:switch]
        continued = fresh_b.generate([prompt + tokens[:switch]], NEW_TOKENS - switch).tokens[0]
        assert tokens[switch:] == continued


def test_a_request_in_flight_ends_when_the_engine_closes() -> None:
    """A held request fails at once with EngineClosedError when the refit fails part-way."""
    engine = _BeginsARefitMidRequest(CONFIG, seed=SEED_A)
    engine.pause_at = 2
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            engine.generate(PROMPTS[:1], NEW_TOKENS)
        except EngineClosedError as exc:
            errors.append(exc)

    request = threading.Thread(target=generate)
    request.start()
    give_up = time.monotonic() + 30
    while engine.serving_state is not GateState.PAUSED:
        assert time.monotonic() < give_up and request.is_alive(), "the refit never began"
        time.sleep(0.005)
    engine.on_refit_abort(1, weights_changed=True)
    request.join(30)
    assert errors and "closed" in str(errors[0])


def test_spans_cover_every_token_of_a_request_without_refit() -> None:
    engine = ReferenceEngine(CONFIG, seed=SEED_A)
    output = engine.generate(PROMPTS, NEW_TOKENS)
    assert output.weight_versions == [[WeightVersionSpan(0, 0, NEW_TOKENS)]] * len(PROMPTS)
    assert engine.generate(PROMPTS[:1], 0).weight_versions == [[]]
