"""Name maps against the reference engine: fuse to its fused layout, split to its checkpoint."""

from __future__ import annotations

import pytest
import torch

from refit_core import TensorSpec
from refit_core.sources import (
    GATE_UP_FUSE,
    GATE_UP_SPLIT,
    QKV_FUSE,
    FuseRule,
    NameMap,
    SplitRule,
    StateDictSource,
    checkpoint_items,
    qkv_split,
)
from refit_lab.digest import state_digest
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint

CONFIG = ReferenceModelConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48)
FUSE = NameMap(fuses=(QKV_FUSE, GATE_UP_FUSE))
SPLIT = NameMap(
    splits=(
        qkv_split(CONFIG.num_heads * CONFIG.head_dim, CONFIG.num_kv_heads * CONFIG.head_dim),
        GATE_UP_SPLIT,
    )
)


def test_fuse_map_matches_the_reference_engine_fused_layout() -> None:
    checkpoint = random_checkpoint(CONFIG, seed=5)
    engine = ReferenceEngine(CONFIG)
    engine.load_weights(checkpoint.items())
    fused = {t.name: t.tensor for t in StateDictSource(checkpoint, name_map=FUSE).iter_tensors()}
    params = dict(engine.model.named_parameters())
    assert list(fused) == list(params)
    for name, param in params.items():
        assert torch.equal(fused[name], param), name
    assert "model.layers.1.self_attn.qkv_proj.weight" in fused
    assert "model.layers.1.mlp.gate_up_proj.weight" in fused


def test_split_map_feeds_the_engine_its_checkpoint_and_round_trips() -> None:
    checkpoint = random_checkpoint(CONFIG, seed=6)
    trainer_state = {
        t.name: t.tensor for t in StateDictSource(checkpoint, name_map=FUSE).iter_tensors()
    }
    source = StateDictSource(trainer_state, name_map=SPLIT)
    info = source.state_dict_info()
    assert list(info) == list(checkpoint)
    assert all(info[name] == TensorSpec.of(tensor) for name, tensor in checkpoint.items())
    engine = ReferenceEngine(CONFIG)
    assert engine.load_weights(checkpoint_items(source.iter_tensors())) == set(checkpoint)
    assert engine.state_digests() == state_digest(checkpoint.items())


def test_rules_match_whole_components_after_renaming() -> None:
    name_map = NameMap(
        rename=lambda n: n.replace("attn.wqkv", "self_attn.qkv_proj"),
        splits=(qkv_split(4, 2),),
    )
    state = {"layers.0.attn.wqkv.weight": torch.arange(16.0).reshape(8, 2)}
    state["layers.0.xself_attn.qkv_proj.weight"] = torch.zeros(8, 2)
    out = {t.name: t.tensor for t in StateDictSource(state, name_map=name_map).iter_tensors()}
    assert list(out) == [
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.xself_attn.qkv_proj.weight",
    ]
    assert out["layers.0.self_attn.k_proj.weight"].tolist() == [[8.0, 9.0], [10.0, 11.0]]


@pytest.mark.parametrize(
    ("state", "name_map", "message"),
    [
        (
            {"mlp.gate_up_proj.weight": torch.zeros(3, 2)},
            NameMap(splits=(GATE_UP_SPLIT,)),
            "do not split",
        ),
        (
            {"a.qkv.weight": torch.zeros(5, 2)},
            NameMap(splits=(SplitRule("qkv", ("q", "k"), (2, 2)),)),
            "split sizes",
        ),
        (
            {"a.q.weight": torch.zeros(2, 2)},
            NameMap(fuses=(FuseRule(("q", "k"), "qk"),)),
            "lacks part",
        ),
        (
            {"a.q.weight": torch.zeros(2, 2), "a.k.weight": torch.zeros(2, 3)},
            NameMap(fuses=(FuseRule(("q", "k"), "qk"),)),
            "unlike",
        ),
        (
            {"a.q.weight": torch.zeros(2)},
            NameMap(fuses=(FuseRule(("q", "k"), "qk"),), splits=(SplitRule("q", ("x", "y")),)),
            "both a split and a fuse",
        ),
        ({"a.q": torch.zeros(1), "b.q": torch.zeros(1)}, lambda n: n[2:], "two tensors to 'q'"),
        (
            {"a.q.weight": torch.tensor(1.0)},
            NameMap(splits=(SplitRule("q", ("x", "y")),)),
            "scalar",
        ),
    ],
)
def test_bad_maps_are_refused(
    state: dict[str, torch.Tensor], name_map: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        StateDictSource(state, name_map=name_map).state_dict_info()  # type: ignore[arg-type]


def test_rule_definitions_are_validated() -> None:
    with pytest.raises(ValueError, match="at least two parts"):
        SplitRule("qkv", ("q",))
    with pytest.raises(ValueError, match="one per part"):
        SplitRule("qkv", ("q", "k"), (1,))
    with pytest.raises(ValueError, match="two distinct parts"):
        FuseRule(("q", "q"), "qq")
