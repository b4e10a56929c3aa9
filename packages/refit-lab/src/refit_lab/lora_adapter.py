"""LoRA adapters of a Qwen2/Llama-shaped model in PEFT's layout, for the engine tier and
``refit bench lora``: random ones, one training step's worth of change, and the directory
PEFT writes (``adapter_config.json`` + ``adapter_model.safetensors``: what vLLM loads from
disk). torch only; writing needs ``safetensors`` (vLLM brings it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from refit_core.sources import StateDictSource
from refit_lab.failing_source import FailingSource

__all__ = ["AdapterPolicy", "random_adapter", "step_adapter", "write_adapter"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _module_shapes(model: Mapping[str, Any]) -> dict[str, tuple[str, int, int]]:
    """Target module -> (its parent, in features, out features)."""
    hidden, inner = int(model["hidden_size"]), int(model["intermediate_size"])
    head_dim = int(model.get("head_dim") or hidden // int(model["num_attention_heads"]))
    q_out = int(model["num_attention_heads"]) * head_dim
    kv_out = int(model["num_key_value_heads"]) * head_dim
    return {
        "q_proj": ("self_attn", hidden, q_out),
        "k_proj": ("self_attn", hidden, kv_out),
        "v_proj": ("self_attn", hidden, kv_out),
        "o_proj": ("self_attn", q_out, hidden),
        "gate_proj": ("mlp", hidden, inner),
        "up_proj": ("mlp", hidden, inner),
        "down_proj": ("mlp", inner, hidden),
    }


def random_adapter(
    model: Mapping[str, Any],
    targets: tuple[str, ...],
    rank: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    scale: float = 0.05,
) -> dict[str, torch.Tensor]:
    """A trained-looking adapter (A and B both non-zero) for every layer of ``model`` (a
    Hugging Face config's fields) and every module of ``targets``, under PEFT's names."""
    shapes = _module_shapes(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(model["num_hidden_layers"])):
        for target in targets:
            parent, features_in, features_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{target}"
            a = torch.randn(rank, features_in, generator=generator) * scale
            b = torch.randn(features_out, rank, generator=generator) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype)
    return tensors


def step_adapter(
    adapter: Mapping[str, torch.Tensor], fraction: float, *, seed: int
) -> dict[str, torch.Tensor]:
    """``adapter`` after a step that changed about ``fraction`` of its elements."""
    generator = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, tensor in adapter.items():
        changed = torch.rand(tensor.shape, generator=generator) < fraction
        noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.02
        stepped[name] = torch.where(changed, tensor + noise, tensor)
    return stepped


def write_adapter(
    folder: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> str:
    """Write the adapter as PEFT does; its path (what ``LoRARequest.lora_path`` takes)."""
    from safetensors.torch import save_file  # type: ignore[import-not-found]  # vLLM brings it

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, str(folder / "adapter_model.safetensors")
    )
    (folder / "adapter_config.json").write_text(json.dumps(dict(config)))
    return str(folder)


class AdapterPolicy:
    """A ``PolicyLike`` over named adapters: ``weight_source()`` yields the one ``state``
    names, failing after ``fail_after`` tensors when set (a trainer dying mid-transfer)."""

    def __init__(self, adapters: Mapping[str, Mapping[str, torch.Tensor]], state: str) -> None:
        self.adapters = adapters
        self.state = state
        self.fail_after: int | None = None

    def weight_source(self) -> StateDictSource | FailingSource:
        source = StateDictSource(dict(self.adapters[self.state]))
        return source if self.fail_after is None else FailingSource(source, self.fail_after)
