"""The transfer plan: packing rules, alignment, solo buckets, digests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit_core import GeometryMismatchError, TensorSpec
from refit_core.backend import CollectiveSenderSpec
from refit_nccl.transfer.plan import ALIGN_BYTES, TransferPlan, torch_dtype

MiB = 1024 * 1024
DTYPES = ["float32", "bfloat16", "float16", "int64", "int8", "uint8", "bool", "float64"]


def refit(buffer_bytes: int = MiB, num_buffers: int = 2) -> CollectiveSenderSpec:
    return CollectiveSenderSpec("refit", buffer_bytes, num_buffers)


specs = st.lists(
    st.tuples(
        st.lists(st.integers(0, 700), min_size=0, max_size=3).map(tuple),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=40,
)


def state_of(items: list[tuple[tuple[int, ...], str]]) -> dict[str, TensorSpec]:
    return {f"t{i}": TensorSpec(shape, dtype) for i, (shape, dtype) in enumerate(items)}


@settings(max_examples=150, deadline=None)
@given(specs)
def test_refit_rule_invariants(items: list[tuple[tuple[int, ...], str]]) -> None:
    state = state_of(items)
    plan = TransferPlan.build(state, refit(MiB))
    slots = [slot for bucket in plan.buckets for slot in bucket.slots]
    assert [s.name for s in slots] == list(state), "every tensor once, in order"
    for bucket in plan.buckets:
        if bucket.solo:
            assert len(bucket.slots) == 1 and bucket.nbytes > MiB
            continue
        assert bucket.nbytes <= MiB
        end = 0
        for slot in bucket.slots:
            assert slot.offset % ALIGN_BYTES == 0, "every view valid for its dtype"
            assert slot.offset >= end, "no overlap"
            assert slot.nbytes == slot.spec.numel * torch_dtype(slot.spec.dtype).itemsize
            end = slot.offset + slot.nbytes
        assert bucket.nbytes == end
    assert plan.dense_bytes == sum(s.nbytes for s in slots)
    assert plan.wire_bytes >= plan.dense_bytes


def test_tensor_larger_than_a_bucket_travels_alone() -> None:
    state = {
        "a": TensorSpec((10,), "float32"),
        "big": TensorSpec((MiB // 4 + 1,), "float32"),
        "b": TensorSpec((3,), "bfloat16"),
    }
    plan = TransferPlan.build(state, refit(MiB))
    assert [(b.solo, [s.name for s in b.slots]) for b in plan.buckets] == [
        (False, ["a"]),
        (True, ["big"]),
        (False, ["b"]),
    ]
    assert plan.buffer_bytes == 40  # the largest packed bucket, not the declared size


def test_buckets_close_before_overflowing() -> None:
    quarter = TensorSpec((MiB // 8,), "float16")  # 256 KiB
    state = {f"q{i}": quarter for i in range(9)}
    plan = TransferPlan.build(state, refit(MiB))
    assert [len(b.slots) for b in plan.buckets] == [4, 4, 1]


def test_vllm_rule_closes_after_exceeding_the_buffer() -> None:
    third = TensorSpec((MiB // 6,), "bfloat16")  # a third of a MiB (minus rounding)
    state = {f"t{i}": third for i in range(7)}
    plan = TransferPlan.build(state, CollectiveSenderSpec("vllm", MiB, 2))
    sizes = [len(b.slots) for b in plan.buckets]
    assert sizes == [4, 3], "vLLM adds tensors until the bucket size exceeds the buffer"
    assert plan.buckets[0].nbytes > MiB
    assert [s.offset for s in plan.buckets[0].slots] == [
        0,
        third.numel * 2,
        2 * third.numel * 2,
        3 * third.numel * 2,
    ]


def test_vllm_rule_refuses_a_misaligned_view() -> None:
    state = {"odd": TensorSpec((3,), "uint8"), "weight": TensorSpec((4,), "bfloat16")}
    with pytest.raises(GeometryMismatchError, match="not a valid view"):
        TransferPlan.build(state, CollectiveSenderSpec("vllm", MiB, 2))


def test_digest_covers_names_dtypes_shapes_order_and_geometry() -> None:
    base = {"a": TensorSpec((4, 4), "float32"), "b": TensorSpec((8,), "bfloat16")}
    digest = TransferPlan.build(base, refit()).digest
    assert TransferPlan.build(dict(base), refit()).digest == digest
    variants = [
        ({"a": TensorSpec((4, 4), "float32"), "c": TensorSpec((8,), "bfloat16")}, refit()),
        ({"a": TensorSpec((4, 4), "float16"), "b": TensorSpec((8,), "bfloat16")}, refit()),
        ({"a": TensorSpec((2, 8), "float32"), "b": TensorSpec((8,), "bfloat16")}, refit()),
        ({"b": TensorSpec((8,), "bfloat16"), "a": TensorSpec((4, 4), "float32")}, refit()),
        (base, refit(2 * MiB)),
        (base, refit(num_buffers=3)),
        (base, CollectiveSenderSpec("vllm", MiB, 2)),
    ]
    digests = {TransferPlan.build(state, geometry).digest for state, geometry in variants}
    assert digest not in digests and len(digests) == len(variants)


def test_unknown_dtype_and_peer_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown torch dtype"):
        TransferPlan.build({"x": TensorSpec((1,), "float99")}, refit())
    with pytest.raises(ValueError, match="no packing rule"):
        TransferPlan.build(
            {"x": TensorSpec((1,), "float32")}, CollectiveSenderSpec("sglang", MiB, 2)
        )
    with pytest.raises(ValueError, match="unknown torch dtype"):
        torch_dtype("Tensor")
    assert torch_dtype("bfloat16") is torch.bfloat16
