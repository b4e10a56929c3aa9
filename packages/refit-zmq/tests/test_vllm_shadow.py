"""The checkpoint-format shadow of a vLLM worker: which layers a push reloads, and when."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refit_core import RefitError
from refit_zmq.vllm.shadow import ShadowWeights, layer_of


class _Model(nn.Module):
    """Records what each ``load_weights`` call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[list[str]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loads.append([name for name, _ in weights])


def test_layer_of_groups_by_outermost_index_else_module() -> None:
    assert layer_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_of("model.layers.3.mlp.experts.7.w1") == "model.layers.3"
    assert layer_of("model.norm.weight") == "model.norm"
    assert layer_of("lm_head.weight") == "lm_head"


def test_push_reloads_whole_changed_layers_only_and_repeats_after_a_failure() -> None:
    names = [
        "model.layers.0.q.weight",
        "model.layers.0.k.weight",
        "model.layers.1.q.weight",
        "lm_head.weight",
    ]
    shadow = ShadowWeights((n, torch.zeros(4, dtype=torch.bfloat16)) for n in names)
    model = _Model()
    shadow.tensors["model.layers.0.k.weight"][1] = 1.0
    shadow.version = 1
    assert shadow.push(1, model) == 2
    assert model.loads[-1] == ["model.layers.0.q.weight", "model.layers.0.k.weight"]

    shadow.tensors["lm_head.weight"][0] = 2.0
    shadow.version = 2
    with pytest.raises(RefitError, match="committed 2"):
        shadow.push(3, model)  # the relay committed 2, not 3
    assert shadow.push(2, model) == 1
    assert model.loads[-1] == ["lm_head.weight"]
    assert shadow.push(2, model) == 0, "nothing changed since"
