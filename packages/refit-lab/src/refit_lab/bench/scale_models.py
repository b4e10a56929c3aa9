"""The models of ``refit bench scale``: Qwen2 shapes with random weights, written as Hugging Face
checkpoints (``config.json`` + ``model.safetensors``), a 1 % delta of one of them, and the
greedy outputs every refit is checked against.

The large model has Qwen2-0.5B's shape (494 M parameters, 988 MB in bf16, tied embeddings,
grouped-query attention, a 151936-token vocabulary); the small one is a ~125 M Qwen2. Weights
are drawn tensor by tensor in bf16 (no model is built), so writing the large one needs no more
than its own bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FULL_MODELS",
    "QUICK_MODELS",
    "ModelShape",
    "changed_copy",
    "random_state",
    "write_checkpoint",
]

CHANGED = 0.01
"""Fraction of the elements a delta changes."""


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 configuration (Hugging Face keys) and the name the bench reports it by."""

    name: str
    config: Mapping[str, Any]

    @property
    def vocab_size(self) -> int:
        """Tokens the prompts are drawn from."""
        return int(self.config["vocab_size"])

    def hf_config(self) -> Any:
        """The transformers ``Qwen2Config``."""
        from transformers import Qwen2Config  # type: ignore[import-not-found]  # vLLM brings it

        return Qwen2Config(**self.config)


_QWEN2 = {"max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}

FULL_MODELS = (
    ModelShape(
        "small",
        {
            **_QWEN2,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
            "tie_word_embeddings": True,
        },
    ),
    ModelShape(
        "large",  # Qwen2-0.5B
        {
            **_QWEN2,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
    ),
)
"""The ~125 M model and the Qwen2-0.5B shape."""

QUICK_MODELS = (
    ModelShape(
        "small",
        {
            **_QWEN2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,  # head_dim 64 (vLLM's CPU attention refuses 16)
            "num_key_value_heads": 1,
            "vocab_size": 2000,
            "tie_word_embeddings": True,
        },
    ),
    ModelShape(
        "large",
        {
            **_QWEN2,
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 8000,
            "tie_word_embeddings": True,
        },
    ),
)
"""Two tiny tied models, for a smoke run and the engine tier's test of the bench."""


def random_state(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of ``shape`` in bf16, drawn at the scale of Qwen2's initializer (norm
    weights about one); a tied model's has no ``lm_head.weight``."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(shape.hf_config())
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, meta in model.state_dict().items():
        if shape.config["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        values = torch.randn(meta.shape, generator=generator, dtype=torch.bfloat16) * 0.02
        state[name] = values + 1 if name.endswith("norm.weight") else values
    return state


def changed_copy(state: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` with :data:`CHANGED` of its elements moved (an RL step's delta)."""
    generator = torch.Generator().manual_seed(seed)
    changed = {}
    for name, tensor in state.items():
        mask = torch.rand(tensor.shape, generator=generator) < CHANGED
        noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.01
        changed[name] = torch.where(mask, tensor + noise, tensor)
    return changed


def write_checkpoint(shape: ModelShape, state: Mapping[str, torch.Tensor], folder: Path) -> float:
    """Write ``state`` as a checkpoint vLLM loads from ``folder`` (what a trainer does for a
    reload from disk); the seconds the safetensors file took."""
    from safetensors.torch import save_file  # type: ignore[import-not-found]  # vLLM brings it

    folder.mkdir(parents=True, exist_ok=True)
    config = shape.hf_config().to_dict()
    config["architectures"] = ["Qwen2ForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    save_file(dict(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return time.perf_counter() - started
