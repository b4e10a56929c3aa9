"""The reshard planner against an oracle cut the way Megatron-Core shards a GPT model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_model import CONFIG, MOE, megatron_shard, natural_state
from refit_nccl.megatron.gpt import GPTConfig, Parallelism, gpt_layouts
from refit_nccl.megatron.layout import ParamLayout, Span
from refit_nccl.megatron.plan import ReshardPlan, plan_reshard

Shards = dict[int, dict[str, torch.Tensor]]


def shards(config: GPTConfig, par: Parallelism, seed: int = 0) -> Shards:
    state = natural_state(config, seed)
    return {r: megatron_shard(state, config, par, r) for r in range(par.world_size)}


def simulate(plan: ReshardPlan, source: Shards) -> Shards:
    """Apply the plan's copies in memory (destination ranks start from NaN-free zeros)."""
    out: Shards = {
        r: {
            name: torch.zeros(layout.local_shape(r), dtype=torch.bfloat16)
            for name, layout in plan.destinations.items()
            if r in layout.holders
        }
        for r in range(plan.destination_world)
    }
    for c in plan.copies:
        dim = plan.sources[c.name].dim
        rows = source[c.src][c.name].narrow(dim, c.src_offset, len(c.span))
        out[c.dst][c.name].narrow(dim, c.dst_offset, len(c.span)).copy_(rows)
    return out


def assert_bitwise(got: Shards, expected: Shards) -> None:
    assert got.keys() == expected.keys()
    for rank, tensors in expected.items():
        assert got[rank].keys() == tensors.keys(), f"rank {rank}"
        for name, tensor in tensors.items():
            assert torch.equal(got[rank][name].view(torch.int16), tensor.view(torch.int16)), name


def reshard(
    config: GPTConfig, src: Parallelism, dst: Parallelism, *, colocated: bool = False
) -> ReshardPlan:
    plan = plan_reshard(gpt_layouts(config, src), gpt_layouts(config, dst), colocated=colocated)
    assert_bitwise(simulate(plan, shards(config, src)), shards(config, dst))
    return plan


def assert_each_row_written_once(plan: ReshardPlan) -> None:
    written: dict[tuple[str, int], list[Span]] = {}
    for c in plan.copies:
        written.setdefault((c.name, c.dst), []).append(c.span)
    for name, layout in plan.destinations.items():
        for rank, spans in layout.holders.items():
            got = sorted(written.pop((name, rank)))
            merged = [got[0]]
            for span in got[1:]:
                assert span.start >= merged[-1].stop, f"{name} rank {rank}: rows written twice"
                merged.append(span)
            assert sum(len(s) for s in got) == sum(len(s) for s in spans)
    assert not written


LAYOUT_CHANGES = {
    "tp2->1": (Parallelism(tp=2), Parallelism(tp=1)),
    "tp1->2": (Parallelism(tp=1), Parallelism(tp=2)),
    "tp4->2": (Parallelism(tp=4), Parallelism(tp=2)),
    "pp2->1": (Parallelism(pp=2), Parallelism(pp=1)),
    "tp2pp2->tp4": (Parallelism(tp=2, pp=2), Parallelism(tp=4)),
}


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_layout_change_is_bitwise_and_sends_the_lower_bound(change: str, colocated: bool) -> None:
    plan = reshard(CONFIG, *LAYOUT_CHANGES[change], colocated=colocated)
    assert_each_row_written_once(plan)
    assert plan.sent_bytes == plan.lower_bound_bytes
    assert plan.lower_bound_bytes <= plan.naive_bytes


def test_non_colocated_lower_bound_is_every_destination_shard() -> None:
    src, dst = LAYOUT_CHANGES["tp4->2"]
    plan = reshard(CONFIG, src, dst)
    expected = sum(
        t.numel() * 2 for tensors in shards(CONFIG, dst).values() for t in tensors.values()
    )
    assert plan.lower_bound_bytes == expected
    model = sum(layout.nbytes for layout in plan.sources.values())
    # naive: gather (3/4 of each tp-split tensor) then the whole model to 2 destination ranks
    assert plan.naive_bytes > 2 * model
    assert plan.world_size == 6 and plan.process_of_destination(1) == 5


def test_colocated_identical_layouts_copy_nothing_across_processes() -> None:
    par = Parallelism(tp=2, pp=2)
    plan = reshard(CONFIG, par, par, colocated=True)
    assert plan.sent_bytes == plan.lower_bound_bytes == 0
    assert all(c.src == c.dst and c.src_offset == c.dst_offset for c in plan.copies)
    spans = sum(len(s) for layout in plan.destinations.values() for s in layout.holders.values())
    assert len(plan.copies) == spans


def test_colocated_tp2_to_tp1_sends_only_what_rank_0_lacks() -> None:
    plan = reshard(CONFIG, Parallelism(tp=2), Parallelism(tp=1), colocated=True)
    assert all(c.src == 1 for c in plan.copies if not plan.is_local(c))
    split = sum(
        layout.nbytes
        for layout in plan.sources.values()
        if len(layout.holders[0]) and layout.local_shape(0) != layout.shape
    )
    assert plan.sent_bytes == split // 2


def test_fused_qkv_shard_is_whole_query_groups() -> None:
    layouts = gpt_layouts(CONFIG, Parallelism(tp=2))
    qkv = layouts["decoder.layers.0.self_attention.linear_qkv.weight"]
    rows_per_group = (CONFIG.heads // CONFIG.query_groups + 2) * CONFIG.head_dim
    assert qkv.holders[1] == (Span(2 * rows_per_group, 4 * rows_per_group),)


def test_gate_up_shard_is_its_gate_slice_then_its_up_slice() -> None:
    fc1 = gpt_layouts(CONFIG, Parallelism(tp=2))["decoder.layers.1.mlp.linear_fc1.weight"]
    assert fc1.holders[1] == (Span(12, 24), Span(36, 48))
    plan = plan_reshard(
        gpt_layouts(CONFIG, Parallelism(tp=2)), gpt_layouts(CONFIG, Parallelism(tp=1))
    )
    fc1_copies = [c for c in plan.copies if c.name == "decoder.layers.1.mlp.linear_fc1.weight"]
    assert [(c.src, c.span, c.dst_offset) for c in fc1_copies] == [
        (0, Span(0, 12), 0),
        (1, Span(12, 24), 12),
        (0, Span(24, 36), 24),
        (1, Span(36, 48), 36),
    ]


def test_replicated_parameter_is_sent_once_per_destination_and_balanced() -> None:
    plan = reshard(CONFIG, Parallelism(tp=2), Parallelism(tp=1))
    norm = [c for c in plan.copies if c.name == "decoder.final_layernorm.weight"]
    assert len(norm) == 1
    plan = reshard(CONFIG, Parallelism(tp=1, dp=2), Parallelism(tp=1, dp=2))
    norm = [c for c in plan.copies if c.name == "decoder.final_layernorm.weight"]
    assert sorted(c.dst for c in norm) == [0, 1]
    sent_by = {r: sum(plan.copy_bytes(c) for c in plan.copies if c.src == r) for r in (0, 1)}
    assert abs(sent_by[0] - sent_by[1]) <= max(plan.copy_bytes(c) for c in plan.copies)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (Parallelism(dp=2, ep=2), Parallelism()),
        (Parallelism(), Parallelism(dp=2, ep=2)),
        (Parallelism(tp=2, dp=2, ep=2), Parallelism(dp=4, ep=4)),
    ],
)
def test_expert_parallel_changes(src: Parallelism, dst: Parallelism) -> None:
    plan = reshard(MOE, src, dst)
    assert plan.sent_bytes == plan.lower_bound_bytes
    expert = plan.sources["decoder.layers.0.mlp.experts.3.linear_fc2.weight"]
    last_ep = {
        src.rank(t, d, 0) for t in range(src.tp) for d in range(src.dp) if d % src.ep == src.ep - 1
    }
    assert set(expert.holders) == last_ep


def test_layout_spans_match_the_oracle_cut() -> None:
    state = natural_state(CONFIG, 3)
    full = megatron_shard(state, CONFIG, Parallelism(), 0)
    for par in (Parallelism(tp=4), Parallelism(tp=2, pp=2, dp=2)):
        for name, layout in gpt_layouts(CONFIG, par).items():
            for rank, spans in layout.holders.items():
                cut = torch.cat(
                    [full[name].narrow(layout.dim, s.start, len(s)) for s in spans], layout.dim
                )
                assert torch.equal(cut, megatron_shard(state, CONFIG, par, rank)[name]), name


def test_planner_rejects_mismatched_layouts() -> None:
    a = {"w": ParamLayout((4, 2), 2, 0, {0: (Span(0, 4),)})}
    with pytest.raises(ValueError, match="differ in parameters"):
        plan_reshard(a, {"v": a["w"]})
    with pytest.raises(ValueError, match="disagree"):
        plan_reshard(a, {"w": ParamLayout((4, 2), 4, 0, {0: (Span(0, 4),)})})
    with pytest.raises(ValueError, match="no source"):
        plan_reshard({"w": ParamLayout((4, 2), 2, 0, {0: (Span(0, 2),)})}, a)
    with pytest.raises(ValueError, match="does not fit"):
        gpt_layouts(CONFIG, Parallelism(tp=8))


tp_sizes = st.sampled_from([1, 2, 4])
parallelisms = st.builds(
    Parallelism, tp=tp_sizes, pp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2])
)


@settings(max_examples=25, deadline=None)
@given(src=parallelisms, dst=parallelisms, colocated=st.booleans())
def test_any_layout_change_is_bitwise_minimal_and_writes_each_row_once(
    src: Parallelism, dst: Parallelism, colocated: bool
) -> None:
    plan = reshard(CONFIG, src, dst, colocated=colocated)
    assert_each_row_written_once(plan)
    assert plan.sent_bytes == plan.lower_bound_bytes <= plan.naive_bytes
