"""Phase ``ipc``: refit's colocated IPC channel on a multi-GiB CUDA state.

The trainer's state (64 bf16 tensors of 64 MiB, 4 GiB) is refit through refit-zmq's
:class:`~refit_zmq.ipc.IpcWeightSynchronizer` (CUDA IPC buffers, ZMQ control) into a
:class:`~refit_lab.cuda_engine.CudaEngine` in a second process. Each round negates the state,
times one device-to-device copy of the same bytes (the reference), then one refit; the ratio is
the median of the per-round ratios of the refit's rate to the copy's. The engine's final
weights are compared bit for bit with the trainer's.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from multiprocessing.queues import Queue
from typing import Any

import torch

from refit_lab.cuda_engine import serve_cuda_engine
from refit_lab.device_check.timing import interleaved_with_device_copy
from refit_lab.digest import state_digest
from refit_lab.trainer import StaticPolicy

__all__ = ["ROUNDS", "TENSORS", "TENSOR_SHAPE", "run"]

TENSORS = 64
TENSOR_SHAPE = (4096, 8192)
"""64 MiB of bf16 each: 4 GiB in all."""
ROUNDS = 3
_TIMEOUT_S = 60.0


def run() -> dict[str, Any]:
    """Rates of the refit and of the device copy, their median ratio, and bit-exactness."""
    import torch.multiprocessing as mp

    from refit_zmq.ipc import IpcOptions, IpcWeightSynchronizer

    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {
        f"layers.{i}.weight": torch.randn(TENSOR_SHAPE, generator=generator, device="cuda").to(
            torch.bfloat16
        )
        for i in range(TENSORS)
    }
    total = sum(t.numel() * t.element_size() for t in state.values())
    specs = {name: (tuple(t.shape), "bfloat16") for name, t in state.items()}
    address = (
        f"ipc://{tempfile.gettempdir()}/refit-device-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    context = mp.get_context("spawn")
    results: Queue[Any] = context.Queue()
    child = context.Process(
        target=serve_cuda_engine, args=(address, specs, ROUNDS + 1, results, _TIMEOUT_S)
    )
    child.start()
    try:
        with IpcWeightSynchronizer(
            StaticPolicy(state),
            lambda: [address],
            refit_timeout_s=_TIMEOUT_S,
            options=IpcOptions(device="cuda"),
        ) as synchronizer:
            synchronizer.sync_weights()  # warm-up: buffers allocated, handles opened
            measured = interleaved_with_device_copy(
                synchronizer.sync_weights, total, ROUNDS, lambda: [t.neg_() for t in state.values()]
            )
        _, digests = results.get(timeout=_TIMEOUT_S)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    exact = digests == state_digest(state.items())
    return {
        "ok": exact,
        "state_bytes": total,
        "tensors": TENSORS,
        "rounds": ROUNDS,
        "ipc_refit_gbps": measured.subject_gbps,
        "device_copy_gbps": measured.reference_gbps,
        "ipc_vs_device_copy": measured.ratio,
        "bitexact": exact,
    }
