"""Megatron-Core GPT parameters -> HF checkpoint names and layouts (Llama / Qwen naming).

The layouts are the ones :mod:`refit_nccl.megatron.gpt` documents; layer ``i`` and expert
``e`` are global numbers. Renames (``decoder.layers.i.`` -> ``model.layers.i.``):

- ``embedding.word_embeddings`` -> ``model.embed_tokens``; ``decoder.final_layernorm`` ->
  ``model.norm``; ``output_layer`` -> ``lm_head``;
- ``self_attention.linear_qkv.layer_norm_weight`` -> ``input_layernorm.weight``;
  ``mlp.linear_fc1.layer_norm_weight`` and MoE's ``pre_mlp_layernorm.weight`` ->
  ``post_attention_layernorm.weight``;
- ``self_attention.linear_qkv`` -> ``self_attn.q_proj`` / ``k_proj`` / ``v_proj``;
  ``self_attention.linear_proj`` -> ``self_attn.o_proj``;
- ``mlp.linear_fc1`` -> ``mlp.gate_proj`` / ``up_proj``; ``mlp.linear_fc2`` -> ``mlp.down_proj``;
- MoE: ``mlp.router`` -> ``mlp.gate``; ``mlp.experts.e.linear_fc1`` ->
  ``mlp.experts.e.gate_proj`` / ``up_proj``; ``mlp.experts.e.linear_fc2`` ->
  ``mlp.experts.e.down_proj`` (Qwen-MoE naming).

A gathered ``linear_qkv`` is interleaved per query group; :func:`to_checkpoint_layout` reorders
its rows into ``q`` rows, then ``k`` rows, then ``v`` rows (vLLM's fused ``qkv_proj``), which
:func:`hf_name_map`'s split rule then cuts. A gathered ``linear_fc1`` already is ``gate`` rows
then ``up`` rows.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from refit_core.sources import NameMap, SplitRule, qkv_split
from refit_nccl.megatron.gpt import GPTConfig

if TYPE_CHECKING:
    import torch

__all__ = ["GATE_UP_ANY_SPLIT", "hf_name", "hf_name_map", "to_checkpoint_layout"]

GATE_UP_ANY_SPLIT = SplitRule("gate_up_proj", ("gate_proj", "up_proj"))
"""A fused ``gate_up_proj`` (dense MLP or expert) -> ``gate_proj`` / ``up_proj``, equal halves."""

_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_EXPERT = {"linear_fc1.weight": "gate_up_proj.weight", "linear_fc2.weight": "down_proj.weight"}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.(\d+)\.(.+)")
_QKV = "self_attention.linear_qkv.weight"


def hf_name(name: str) -> str:
    """The HF name of Megatron parameter ``name`` (fused ``qkv_proj`` / ``gate_up_proj`` kept).

    Raises:
        ValueError: ``name`` is no parameter of a Megatron-Core GPT model.
    """
    if name in _TOP:
        return _TOP[name]
    layer = _LAYER_NAME.fullmatch(name)
    if layer is not None:
        index, rest = layer.groups()
        if rest in _LAYER:
            return f"model.layers.{index}.{_LAYER[rest]}"
        expert = _EXPERT_NAME.fullmatch(rest)
        if expert is not None and expert.group(2) in _EXPERT:
            return f"model.layers.{index}.mlp.experts.{expert.group(1)}.{_EXPERT[expert.group(2)]}"
    raise ValueError(f"{name!r} is no Megatron-Core GPT parameter this source knows")


def hf_name_map(config: GPTConfig) -> NameMap:
    """Megatron names -> HF names with ``q_proj`` / ``k_proj`` / ``v_proj`` and
    ``gate_proj`` / ``up_proj`` split out (the layout HF checkpoints and ``load_weights`` use)."""
    d = config.head_dim
    return NameMap(
        rename=hf_name,
        splits=(qkv_split(config.heads * d, config.query_groups * d), GATE_UP_ANY_SPLIT),
    )


def to_checkpoint_layout(name: str, tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Gathered Megatron parameter ``name`` in HF row order: a ``linear_qkv`` un-interleaved
    into ``q`` rows, ``k`` rows, ``v`` rows (a new tensor); anything else unchanged."""
    import torch

    if not name.endswith(_QKV):
        return tensor
    groups, per_group = config.query_groups, config.heads // config.query_groups
    rest = tensor.shape[1:]
    grouped = tensor.view(groups, per_group + 2, config.head_dim, *rest)
    return torch.cat(
        [
            grouped[:, :per_group].reshape(-1, *rest),
            grouped[:, per_group].reshape(-1, *rest),
            grouped[:, per_group + 1].reshape(-1, *rest),
        ]
    )
