"""A small GPT-like model and its Megatron-Core shards, built independently of the planner.

The test oracle: per-rank state dicts are cut from natural tensors (separate q, k, v, gate, up)
the way Megatron-Core lays them out, without :mod:`refit_nccl.megatron.layout`'s spans.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_nccl.megatron.gpt import GPTConfig, Parallelism
from refit_nccl.megatron.layout import ParamLayout

CONFIG = GPTConfig(layers=2, hidden=16, heads=8, query_groups=4, ffn=24, vocab=32)
MOE = GPTConfig(layers=2, hidden=8, heads=4, query_groups=4, ffn=8, vocab=16, experts=4)

Natural = dict[str, torch.Tensor]


def natural_state(config: GPTConfig, seed: int) -> Natural:
    """Unfused bf16 weights: q/k/v per layer, gate/up per MLP (or per expert)."""
    g = torch.Generator().manual_seed(seed)
    h, d, f = config.hidden, config.head_dim, config.ffn

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {
        "embedding": rand(config.vocab, h),
        "final_norm": rand(h),
        "output": rand(config.vocab, h),
    }
    for i in range(config.layers):
        state |= {
            f"{i}.qkv_norm": rand(h),
            f"{i}.q": rand(config.heads * d, h),
            f"{i}.k": rand(config.query_groups * d, h),
            f"{i}.v": rand(config.query_groups * d, h),
            f"{i}.proj": rand(h, config.heads * d),
            f"{i}.mlp_norm": rand(h),
        }
        mlps = [f"{i}.e{e}" for e in range(config.experts)] or [f"{i}.mlp"]
        if config.experts:
            state[f"{i}.router"] = rand(config.experts, h)
        for mlp in mlps:
            state |= {f"{mlp}.gate": rand(f, h), f"{mlp}.up": rand(f, h), f"{mlp}.fc2": rand(h, f)}
    return state


def megatron_shard(
    state: Natural, config: GPTConfig, par: Parallelism, rank: int
) -> dict[str, torch.Tensor]:
    """The global-named parameters ``rank`` holds under ``par``, as Megatron-Core holds them."""
    t = rank % par.tp
    dp_rank = rank // par.tp % par.dp
    stage = rank // (par.tp * par.dp)
    per_stage = config.layers // par.pp
    d, qpg = config.head_dim, config.heads // config.query_groups
    groups = config.query_groups // par.tp

    def col(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(par.tp, 0)[t].clone()

    def row(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(par.tp, 1)[t].clone()

    out: dict[str, torch.Tensor] = {}
    if stage == 0:
        out["embedding.word_embeddings.weight"] = col(state["embedding"])
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        pre, att = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        fused = []
        for grp in range(t * groups, (t + 1) * groups):
            fused += [
                state[f"{i}.q"][grp * qpg * d : (grp + 1) * qpg * d],
                state[f"{i}.k"][grp * d : (grp + 1) * d],
                state[f"{i}.v"][grp * d : (grp + 1) * d],
            ]
        out[att + "linear_qkv.weight"] = torch.cat(fused)
        out[att + "linear_qkv.layer_norm_weight"] = state[f"{i}.qkv_norm"].clone()
        out[att + "linear_proj.weight"] = row(state[f"{i}.proj"])
        if not config.experts:
            out[pre + "mlp.linear_fc1.layer_norm_weight"] = state[f"{i}.mlp_norm"].clone()
            mlps = {pre + "mlp.": f"{i}.mlp"}
        else:
            out[pre + "pre_mlp_layernorm.weight"] = state[f"{i}.mlp_norm"].clone()
            out[pre + "mlp.router.weight"] = state[f"{i}.router"].clone()
            per_ep = config.experts // par.ep
            first = dp_rank % par.ep * per_ep
            mlps = {f"{pre}mlp.experts.{e}.": f"{i}.e{e}" for e in range(first, first + per_ep)}
        for prefix, key in mlps.items():
            gate_up = torch.cat([col(state[f"{key}.gate"]), col(state[f"{key}.up"])])
            out[prefix + "linear_fc1.weight"] = gate_up
            out[prefix + "linear_fc2.weight"] = row(state[f"{key}.fc2"])
    if stage == par.pp - 1:
        out["decoder.final_layernorm.weight"] = state["final_norm"].clone()
        out["output_layer.weight"] = col(state["output"])
    return out


@dataclass
class Side:
    """A :class:`~refit_nccl.megatron.MegatronSide` over fixed shards."""

    layouts: dict[str, ParamLayout]
    rank: int | None
    shards: dict[str, torch.Tensor] = field(default_factory=dict)

    def megatron_layouts(self) -> Mapping[str, ParamLayout]:
        return self.layouts

    def megatron_rank(self) -> int | None:
        return self.rank

    def megatron_shards(self) -> Mapping[str, torch.Tensor]:
        return self.shards


@dataclass(frozen=True)
class FixedCluster:
    """A ``ClusterLike`` whose rendezvous is a fixed local port."""

    port: int

    def world_size(self) -> int:
        return 1

    def get_placement_groups(self) -> list[Any]:
        return []

    def get_master_address_and_port(self) -> tuple[str, int]:
        return "127.0.0.1", self.port
