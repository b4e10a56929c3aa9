"""The plain weight source over a module or a state dict."""

from __future__ import annotations

import pytest
import torch

from refit_core.sources import StateDictSource, WeightSource


def test_module_source_maps_names_casts_once_and_reads_current_weights() -> None:
    module = torch.nn.Linear(4, 3)
    source = StateDictSource(module, dtype="bfloat16", name_map=lambda n: f"model.{n}")
    assert isinstance(source, WeightSource)
    info = source.state_dict_info()
    assert list(info) == ["model.weight", "model.bias"]
    assert info["model.weight"].shape == (3, 4) and info["model.weight"].dtype == "bfloat16"
    with torch.no_grad():
        module.weight.add_(1.0)
    tensors = {t.name: t.tensor for t in source.iter_tensors()}
    assert torch.equal(tensors["model.weight"], module.weight.detach().to(torch.bfloat16))
    assert [t.dtype for t in tensors.values()] == [torch.bfloat16, torch.bfloat16]


def test_integer_tensors_keep_their_dtype() -> None:
    source = StateDictSource({"steps": torch.arange(3), "w": torch.ones(2)}, dtype="float16")
    info = source.state_dict_info()
    assert info["steps"].dtype == "int64" and info["w"].dtype == "float16"


def test_name_collisions_are_refused() -> None:
    source = StateDictSource({"a": torch.ones(1), "b": torch.ones(1)}, name_map=lambda _: "x")
    with pytest.raises(ValueError, match="two tensors to 'x'"):
        list(source.iter_tensors())


def test_iteration_order_matches_info() -> None:
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(5)}
    source = StateDictSource(state)
    assert [t.name for t in source.iter_tensors()] == list(source.state_dict_info())
