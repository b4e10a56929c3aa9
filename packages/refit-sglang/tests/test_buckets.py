"""Flattened buckets and the shared-memory handles that carry them."""

from __future__ import annotations

import base64
import gc
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refit_sglang.buckets import FlattenedBucket, iter_buckets
from refit_sglang.handles import SharedBuffers
from refit_sglang.plan import DistributedPlan, sglang_geometry

MIXED = [
    ("a", torch.randn(4, 8, dtype=torch.float32)),
    ("b", torch.randn(16, dtype=torch.float32).to(torch.bfloat16)),
    ("c", torch.arange(10, dtype=torch.int64)),
    ("d", torch.randn(3, 5, dtype=torch.float32)),
    ("e", torch.randn(2, 2, dtype=torch.float32).to(torch.bfloat16)),
]


def test_buckets_group_by_dtype_and_rebuild_bitwise() -> None:
    buckets = list(iter_buckets(MIXED, 1 << 20))
    assert [last for _, last in buckets] == [False, False, True]
    by_dtype = {b.flattened_tensor.dtype: b for b, _ in buckets}
    assert [m.name for m in by_dtype[torch.float32].metadata] == ["a", "d"]
    rebuilt = dict(view for bucket, _ in buckets for view in bucket.views())
    for name, tensor in MIXED:
        assert torch.equal(rebuilt[name], tensor) and rebuilt[name].dtype == tensor.dtype


def test_views_are_zero_copy() -> None:
    bucket = FlattenedBucket.build(MIXED[:1] + MIXED[3:4])
    base = bucket.flattened_tensor.untyped_storage().data_ptr()
    for _, view in bucket.views():
        assert view.untyped_storage().data_ptr() == base
    bucket.views()[1][1].fill_(7.0)
    assert bucket.flattened_tensor[-1].item() == 7.0


def test_bucket_size_limits_and_large_tensors_travel_alone() -> None:
    tensors = [(f"t{i}", torch.zeros(256, dtype=torch.float32)) for i in range(5)]
    tensors.insert(2, ("big", torch.zeros(4096, dtype=torch.float32)))
    sizes = [[m.name for m in b.metadata] for b, _ in iter_buckets(tensors, 2048)]
    assert sizes == [["t0", "t1"], ["big"], ["t2", "t3"], ["t4"]]


def test_a_bucket_holds_one_dtype() -> None:
    with pytest.raises(ValueError, match="one dtype"):
        FlattenedBucket.build(MIXED[:2])


def test_distributed_plan_digest_follows_geometry() -> None:
    from refit_core import TensorSpec

    state = tuple(
        (n, TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))) for n, t in MIXED
    )
    plan = DistributedPlan.build(state, sglang_geometry(1 << 20))
    assert sorted(n for b in plan.buckets for n, _ in b) == sorted(n for n, _ in MIXED)
    assert plan.digest == DistributedPlan.build(state, sglang_geometry(1 << 20)).digest
    assert plan.digest != DistributedPlan.build(state, sglang_geometry(2 << 20)).digest


def _segments() -> set[Path]:
    """This process's shared-memory segments (torch's file-system strategy names them)."""
    return set(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))


def test_shared_buffers_release_their_memory() -> None:
    before = _segments()
    buffers = SharedBuffers()
    ((bucket, _),) = iter_buckets(MIXED[:1], 1 << 20, buffers.allocate)
    payloads = buffers.serialize(bucket, copies=2)
    assert len(payloads) == 2 and len(_segments() - before) == 1
    for payload in payloads:  # each receiver unpickles its own reference
        received = pickle.loads(base64.b64decode(payload))
        assert torch.equal(received["flattened_tensor"], bucket.flattened_tensor)
        assert [m.name for m in received["metadata"]] == [MIXED[0][0]]
    assert buffers.live_bytes == bucket.nbytes
    buffers.release(bucket)
    assert buffers.live_bytes == 0 and buffers.peak_bytes == bucket.nbytes
    del bucket, received
    gc.collect()
    assert _segments() <= before, "the segment outlived every reference"


_RECEIVER = """
import base64, pickle, sys
for line in sys.stdin:
    bucket = pickle.loads(base64.b64decode(line))
    flat = bucket["flattened_tensor"]
    views = [(m.name, flat[m.start_idx : m.end_idx].view(m.shape)) for m in bucket["metadata"]]
    print(repr([(n, float(v.double().sum())) for n, v in views]))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_another_process_maps_the_buckets() -> None:
    buffers = SharedBuffers()
    buckets = [bucket for bucket, _ in iter_buckets(MIXED, 1 << 20, buffers.allocate)]
    done = subprocess.run(
        [sys.executable, "-c", _RECEIVER],
        input="\n".join(buffers.serialize(bucket)[0] for bucket in buckets) + "\n",
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    expected = [repr([(n, float(v.double().sum())) for n, v in b.views()]) for b in buckets]
    assert done.stdout.splitlines() == expected
    for bucket in buckets:
        buffers.release(bucket)
    assert buffers.live_bytes == 0
