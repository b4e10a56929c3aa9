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
import statistics
import tempfile
import time
import uuid
from multiprocessing.queues import Queue
from typing import Any

import torch

from refit_core.sources import StateDictSource
from refit_lab.cuda_engine import CudaEngine
from refit_lab.device_check.timing import cuda_gbps
from refit_lab.digest import state_digest

__all__ = ["ROUNDS", "TENSORS", "TENSOR_SHAPE", "run"]

TENSORS = 64
TENSOR_SHAPE = (4096, 8192)
"""64 MiB of bf16 each: 4 GiB in all."""
ROUNDS = 3
_TIMEOUT_S = 60.0


class _Policy:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)


def _serve(
    address: str, specs: dict[str, tuple[tuple[int, ...], str]], refits: int, out: Queue[Any]
) -> None:
    """Child: an engine on the GPU serving ``refits`` refits; its final digests."""
    from refit_zmq.ipc import IpcReceiver

    engine = CudaEngine(specs)
    receiver = IpcReceiver(engine, bind_address=address)
    try:
        for _ in range(refits):
            receiver.serve_refit(timeout_s=_TIMEOUT_S)
    finally:
        receiver.close()
    out.put(state_digest(engine.weights.items()))


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
    flat_source = torch.empty(total, dtype=torch.uint8, device="cuda")
    flat_target = torch.empty_like(flat_source)
    specs = {name: (tuple(t.shape), "bfloat16") for name, t in state.items()}
    address = (
        f"ipc://{tempfile.gettempdir()}/refit-device-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    context = mp.get_context("spawn")
    results: Queue[Any] = context.Queue()
    child = context.Process(target=_serve, args=(address, specs, ROUNDS + 1, results))
    child.start()
    copy_rates: list[float] = []
    refit_rates: list[float] = []
    try:
        with IpcWeightSynchronizer(
            _Policy(state),
            lambda: [address],
            refit_timeout_s=_TIMEOUT_S,
            options=IpcOptions(device="cuda"),
        ) as synchronizer:
            synchronizer.sync_weights()  # warm-up: buffers allocated, handles opened
            for _ in range(ROUNDS):
                for tensor in state.values():
                    tensor.neg_()
                copy_rates.append(cuda_gbps(lambda: flat_target.copy_(flat_source), total))
                torch.cuda.synchronize()
                started = time.perf_counter()
                synchronizer.sync_weights()
                refit_rates.append(total / (time.perf_counter() - started) / 1e9)
        digests = results.get(timeout=_TIMEOUT_S)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    exact = digests == state_digest(state.items())
    ratio = statistics.median(r / c for r, c in zip(refit_rates, copy_rates, strict=True))
    return {
        "ok": exact,
        "state_bytes": total,
        "tensors": TENSORS,
        "rounds": ROUNDS,
        "ipc_refit_gbps": statistics.median(refit_rates),
        "device_copy_gbps": statistics.median(copy_rates),
        "ipc_vs_device_copy": ratio,
        "bitexact": exact,
    }
