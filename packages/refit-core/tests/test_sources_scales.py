"""Quantization scales ride with their owners; the cast rule; bucket packing."""

from __future__ import annotations

import pytest
import torch

from refit_core.sources import (
    SCALES_KEY,
    DTensorSource,
    NameMap,
    StateDictSource,
    checkpoint_items,
    qkv_split,
)
from refit_core.sources.cast import cast_once
from refit_core.sources.scales import scale_owner


def _quantized_state() -> dict[str, torch.Tensor]:
    return {
        "m.k_proj.k_scale": torch.tensor(0.5),  # before its owner: still rides with it
        "m.k_proj.weight": torch.randn(4, 256),
        "m.k_proj.weight_scale_inv": torch.rand(1, 2),
        "m.o_proj.weight": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "m.o_proj.weight_scale": torch.rand(1, 1),
        "m.step": torch.arange(3),
    }


def test_scales_ride_in_their_owner_metadata_uncast() -> None:
    source = StateDictSource(_quantized_state(), dtype="bfloat16")
    tensors = list(source.iter_tensors())
    assert [t.name for t in tensors] == ["m.k_proj.weight", "m.o_proj.weight", "m.step"]
    k_scales = tensors[0].metadata[SCALES_KEY]
    assert list(k_scales) == ["m.k_proj.k_scale", "m.k_proj.weight_scale_inv"]
    assert {t.dtype for t in k_scales.values()} == {torch.float32}
    assert tensors[0].tensor.dtype == torch.bfloat16
    assert tensors[1].tensor.dtype == torch.float8_e4m3fn
    assert tensors[2].tensor.dtype == torch.int64 and SCALES_KEY not in tensors[2].metadata
    info = source.state_dict_info()
    assert [name for name, _ in checkpoint_items(tensors)] == list(info)
    assert info["m.k_proj.k_scale"].dtype == "float32"


def test_scale_owner_rule() -> None:
    assert scale_owner("model.layers.0.self_attn.k_proj.k_scale") == (
        "model.layers.0.self_attn.k_proj.weight"
    )
    assert scale_owner("lm_head.weight_scale_inv") == "lm_head.weight"
    assert scale_owner("lm_head.weight") is None


@pytest.mark.parametrize(
    ("state", "name_map"),
    [
        ({"m.k_scale": torch.tensor(1.0), "m.k_proj.weight": torch.zeros(2, 2)}, None),
        (
            {
                "a.self_attn.qkv_proj.weight": torch.zeros(8, 2),
                "a.self_attn.qkv_proj.weight_scale": torch.ones(1),
            },
            NameMap(splits=(qkv_split(4, 2),)),
        ),
    ],
)
def test_orphan_scales_and_scales_of_split_tensors_are_refused(
    state: dict[str, torch.Tensor], name_map: NameMap | None
) -> None:
    with pytest.raises(ValueError, match="without an unsplit, unfused owner"):
        StateDictSource(state, name_map=name_map).state_dict_info()


def test_engine_dtype_must_be_a_wide_float() -> None:
    with pytest.raises(ValueError, match="quantize in the trainer"):
        StateDictSource({"w": torch.ones(1)}, dtype="float8_e4m3fn").state_dict_info()


def test_casting_shards_equals_casting_the_whole_bitwise() -> None:
    specials = torch.tensor(
        [-0.0, 0.0, float("inf"), float("-inf"), 3.4e38, 1e-40, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]
    )
    nan_payloads = torch.tensor([0x7FC00001, 0x7F800F00, -0x00400001], dtype=torch.int32)
    whole = torch.cat([specials, nan_payloads.view(torch.float32), torch.randn(1001)])
    for dtype in ("bfloat16", "float16"):
        shards = torch.cat([cast_once(chunk, dtype) for chunk in whole.chunk(3)])
        cast = cast_once(whole, dtype)
        assert torch.equal(shards.view(torch.int16), cast.view(torch.int16)), dtype


def test_buckets_pack_units_by_engine_bytes_and_a_large_unit_travels_alone() -> None:
    state = {f"w{i}": torch.zeros(256) for i in range(5)}  # 512 bytes each in bfloat16
    state["big"] = torch.zeros(2048)
    source = DTensorSource(state, dtype="bfloat16", bucket_size_bytes=1100)
    assert source.sends
    buckets = list(source.iter_buckets())
    assert [list(b.info) for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"], ["big"]]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    assert [t.name for b in buckets for t in b.tensors] == list(source.state_dict_info())
    per_unit = DTensorSource(state, bucket_size_bytes=None)
    assert len(list(per_unit.iter_buckets())) == len(state)
    assert not list(DTensorSource(state, sender_ranks=()).iter_tensors())
    with pytest.raises(ValueError, match="bucket_size_bytes"):
        DTensorSource(state, bucket_size_bytes=0)
