"""The trainer's weights as a Hugging Face Llama checkpoint that vLLM starts on.

:class:`~refit_lab.reference_engine.ReferenceModel` follows vLLM's ``LlamaForCausalLM``:
HF Llama tensor names, RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``, SwiGLU with SiLU,
rotate-half (NeoX) rotary embeddings, no biases, an untied ``lm_head``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from refit_lab.reference_engine import ReferenceModelConfig

__all__ = ["llama_config", "write_llama_checkpoint"]


def llama_config(config: ReferenceModelConfig) -> dict[str, object]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``config``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": config.dtype,
    }


def write_llama_checkpoint(
    config: ReferenceModelConfig, state: Mapping[str, torch.Tensor], path: Path
) -> Path:
    """Write ``state`` (HF Llama names) and its config under ``path``; ``path``."""
    from safetensors.torch import save_file  # type: ignore[import-not-found]  # vLLM brings it

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(llama_config(config), indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    return path
