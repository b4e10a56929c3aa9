"""Child-process targets of the GPU test (importable by name, as spawn needs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from multiprocessing.queues import Queue
from typing import Any

import torch

from refit_lab.digest import state_digest
from refit_zmq.ipc import IpcReceiver


class CudaEngine:
    """An engine whose weights live on the GPU, loaded straight from the CUDA IPC buffers."""

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        self.specs = dict(specs)
        self.weights = {
            name: torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda")
            for name, (shape, dtype) in specs.items()
        }
        self.version = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.weights[name].copy_(tensor)

    def set_weight_version(self, version: int) -> None:
        self.version = version

    def reset_prefix_cache(self) -> None:
        pass

    def checkpoint_tensor_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.specs


def serve_cuda_engine(
    address: str, specs: dict[str, tuple[tuple[int, ...], str]], refits: int, out: Queue[Any]
) -> None:
    """Serve ``refits`` refits into a :class:`CudaEngine`; put its version and digests."""
    engine = CudaEngine(specs)
    receiver = IpcReceiver(engine, bind_address=address)
    try:
        for _ in range(refits):
            receiver.serve_refit(timeout_s=120)
    finally:
        receiver.close()
    out.put((engine.version, state_digest(engine.weights.items())))
