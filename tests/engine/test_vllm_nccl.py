"""refit's side of vLLM's own NCCL weight transfer, against the installed vLLM (0.32.0, CPU).

What runs without a GPU, with vLLM's own code on the other side:

* the init and update info refit sends (directly and through Dynamo's admin payloads) are
  vLLM's own dataclasses and parse as vLLM's receiver parses them;
* vLLM's packed consumer, fed exactly that info, asks for the buckets refit's plan sends
  (its communicator is a recorder here: NCCL needs a GPU);
* refit's trainer communicator publishes NCCL's unique id in the group's own store, under
  ``broadcast_from/0/0`` and without a prefix, where vLLM's worker-side code reads it (NCCL's
  library loads on CPU, from the workspace's nvidia-nccl wheel; ``ncclCommInitRank`` then
  needs a GPU, so the connect fails there, and the test checks that it fails cleanly).

The transfer itself (vLLM engines on GPUs) is ``test_vllm_nccl_gpu.py`` (marked ``gpu``).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from refit_core import GeometryMismatchError, TensorSpec
from refit_core.backend import CollectiveSenderSpec
from refit_lab.ray_cluster import free_port
from refit_nccl.backend import TransferPlan
from refit_nccl.vllm_native import nccl_init_info, nccl_update_info

pytestmark = pytest.mark.engine

MiB = 1 << 20
GEOMETRY = CollectiveSenderSpec("vllm", MiB, 2)
STATE = {
    "embed.weight": TensorSpec((400, 512), "bfloat16"),
    "norm.weight": TensorSpec((512,), "float32"),
    "layers.0.qkv.weight": TensorSpec((480, 512), "bfloat16"),
    "layers.0.mask": TensorSpec((16,), "bool"),
    "huge.weight": TensorSpec((300_000,), "float32"),
    "after.weight": TensorSpec((5, 3), "float16"),
    "empty.weight": TensorSpec((0, 4), "bfloat16"),
    "last.weight": TensorSpec((700, 512), "bfloat16"),
}
REPO = Path(__file__).resolve().parents[2]


def test_init_and_update_info_are_vllms_own() -> None:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from refit_dynamo.protocol import init_payload, update_info

    init = nccl_init_info("10.0.0.7", 29511, 1, 3, GEOMETRY)
    parsed = NCCLWeightTransferInitInfo(**init)
    assert (parsed.master_address, parsed.master_port, parsed.rank_offset) == ("10.0.0.7", 29511, 1)
    assert parsed.world_size == 3 and parsed.nccl_unique_id_bytes is None
    assert (parsed.packed, parsed.packed_buffer_size_bytes, parsed.packed_num_buffers) == (
        True,
        MiB,
        2,
    )
    update = nccl_update_info(STATE, GEOMETRY)
    typed = NCCLWeightTransferUpdateInfo(**update)  # vLLM 0.32 refuses unknown keys here
    assert typed.names == list(STATE)
    assert typed.dtype_names == [spec.dtype for spec in STATE.values()]
    assert typed.shapes == [list(spec.shape) for spec in STATE.values()]
    # A Dynamo worker on vLLM's NCCL engine receives the same info through its admin routes.
    payload = init_payload("10.0.0.7", 29511, 1, 3, GEOMETRY, vllm_nccl=True)
    assert payload == {"engine_rpc": "init_weight_transfer_engine", "init_info": init}
    assert update_info(STATE, vllm_nccl=GEOMETRY) == update
    with pytest.raises(ValueError, match="vLLM's rule"):
        nccl_init_info("h", 1, 1, 2, CollectiveSenderSpec("refit", MiB, 2))


class _Recorder:
    """Stands in for ``PyNcclCommunicator`` in vLLM's consumer: records each bucket's size."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        assert src == 0
        self.sizes.append(tensor.numel())


def test_vllms_consumer_asks_for_the_buckets_refits_plan_sends() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm.distributed.weight_transfer import packed_tensor
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm_peer_ranks import _cpu_streams

    init = NCCLWeightTransferInitInfo(**nccl_init_info("127.0.0.1", 1, 1, 2, GEOMETRY))
    update = NCCLWeightTransferUpdateInfo(**nccl_update_info(STATE, GEOMETRY))
    # What NCCLWeightTransferEngine.receive_weights runs, fed what refit sent.
    metadata = (
        (name, (shape, getattr(torch, dtype)))
        for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes, strict=True)
    )
    loaded: list[str] = []
    recorder = _Recorder()
    with _cpu_streams(packed_tensor):
        packed_tensor.packed_nccl_broadcast_consumer(
            iterator=metadata,
            group=recorder,
            src=0,
            post_unpack_func=lambda items: loaded.extend(name for name, _ in items),
            buffer_size_bytes=init.packed_buffer_size_bytes,
            num_buffers=init.packed_num_buffers,
            device="cpu",
        )
    plan = TransferPlan.build(STATE, GEOMETRY)
    assert recorder.sizes == [bucket.nbytes for bucket in plan.buckets]
    assert len(plan.buckets) >= 2 and loaded == list(STATE)
    # A state vLLM's consumer would cut into misaligned views is refused before any send.
    misaligned = {"odd.mask": TensorSpec((11,), "bool"), **STATE}
    with pytest.raises(GeometryMismatchError):
        TransferPlan.build(misaligned, GEOMETRY)
    assert plan.dense_bytes == sum(
        math.prod(s.shape) * getattr(torch, s.dtype).itemsize for s in STATE.values()
    )


def _workspace_nccl() -> str:
    found = sorted(REPO.glob(".venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"))
    if not found:
        pytest.skip("the workspace venv holds no libnccl.so.2 (uv sync brings nvidia-nccl)")
    return str(found[0])


@pytest.mark.timeout(120)
def test_the_unique_id_is_published_where_vllms_worker_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._C._distributed_c10d import TCPStore
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    from vllm.distributed.utils import StatelessProcessGroup

    from refit_nccl.vllm_native.communicator import VllmNcclCommunicator

    monkeypatch.setenv("VLLM_NCCL_SO_PATH", _workspace_nccl())
    port = free_port()
    received: dict[str, Any] = {}

    def vllm_worker() -> None:
        # What vLLM's PyNcclCommunicator runs on every rank but 0 (vllm.distributed.utils).
        group = StatelessProcessGroup.create("127.0.0.1", port, 1, 2, store_timeout=60)
        received["unique_id"] = group.broadcast_obj(None, src=0)

    worker = threading.Thread(target=vllm_worker)
    worker.start()
    # The store as refit's group opens it: rank 0 hosts it on the group's port.
    store = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60))
    communicator = VllmNcclCommunicator(store, 0, 2, torch.device("cuda", 0))
    started = time.monotonic()
    # No GPU: vLLM's init stops at the device, after the unique id went out.
    with pytest.raises(RuntimeError, match="accelerator|CUDA|NCCL"):
        communicator.connect(timedelta(seconds=60))
    worker.join(60)
    assert time.monotonic() - started < 60, "the failure must not wait for the timeout"
    unique_id = received["unique_id"]
    assert isinstance(unique_id, ncclUniqueId) and any(bytes(unique_id.internal))
    client = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    assert client.check(["broadcast_from/0/0"])  # raw key: no group prefix
    communicator.abort()
    assert communicator.aborted
    with pytest.raises(RuntimeError, match="not connected or was aborted"):
        communicator.broadcast([torch.zeros(1)], type("Opts", (), {"rootRank": 0})())


def test_a_world_of_one_is_refused() -> None:
    from torch._C._distributed_c10d import HashStore

    from refit_nccl.vllm_native.communicator import VllmNcclCommunicator

    with pytest.raises(ValueError, match="trainer and engine ranks"):
        VllmNcclCommunicator(HashStore(), 0, 1, torch.device("cuda", 0))
