"""Packing into bucket bytes and viewing back out, in one process."""

from __future__ import annotations

import pytest
import torch

from nccl_workers import MiB, bitwise_differences, info_of, mixed_state
from refit_core import ProtocolError
from refit_core.backend import CollectiveSenderSpec
from refit_nccl.transfer.packing import check_tensor, pack_bucket, unpack_bucket
from refit_nccl.transfer.plan import TransferPlan


@pytest.mark.parametrize("peer", ["refit", "vllm"])
def test_pack_then_unpack_is_bitwise(peer: str) -> None:
    state = mixed_state(seed=11, filler_bytes=2 * MiB, bucket_bytes=MiB)
    if peer == "vllm":
        state = {n: t for n, t in state.items() if t.element_size() == 2}
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec(peer, MiB, 2))
    tensors = iter(state.values())
    received: dict[str, torch.Tensor] = {}
    for bucket in plan.buckets:
        batch = [next(tensors) for _ in bucket.slots]
        buffer = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
        pack_bucket(bucket, batch, buffer)
        for name, view in unpack_bucket(bucket, buffer):
            same_storage = view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert same_storage or view.numel() == 0, "views alias the bucket, no copy"
            received[name] = view.clone()
    assert bitwise_differences(state, received) == []
    assert any(not t.is_contiguous() for t in state.values())


def test_check_tensor_refuses_what_the_plan_does_not_expect() -> None:
    state = {"w": torch.zeros(2, 3)}
    slot = (
        TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", MiB, 2))
        .buckets[0]
        .slots[0]
    )
    check_tensor(slot, "w", torch.ones(2, 3))
    with pytest.raises(ProtocolError, match="plan expects"):
        check_tensor(slot, "v", torch.ones(2, 3))
    with pytest.raises(ProtocolError, match="plan expects"):
        check_tensor(slot, "w", torch.ones(3, 2))
    with pytest.raises(ProtocolError, match="plan expects"):
        check_tensor(slot, "w", torch.ones(2, 3, dtype=torch.float64))
