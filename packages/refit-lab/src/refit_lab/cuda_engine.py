"""An engine whose weights live on a CUDA device (for GPU tests and the device check)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from multiprocessing.queues import Queue
from typing import Any

import torch

from refit_lab.digest import state_digest

__all__ = ["CudaEngine", "serve_cuda_engine"]


class CudaEngine:
    """Weights of the given specs on ``device``, loaded by copy (as an engine's worker loads
    them from a transport's buffers); versioned, with a prefix cache to drop."""

    def __init__(
        self, specs: Mapping[str, tuple[tuple[int, ...], str]], device: str = "cuda"
    ) -> None:
        self.specs = dict(specs)
        self.weights = {
            name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            for name, (shape, dtype) in specs.items()
        }
        self.version = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each named tensor into the weight of that name."""
        for name, tensor in weights:
            self.weights[name].copy_(tensor)

    def set_weight_version(self, version: int) -> None:
        """Commit ``version``."""
        self.version = version

    def reset_prefix_cache(self) -> None:
        """No cache to drop."""

    def checkpoint_tensor_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, dtype name) of every weight."""
        return self.specs


def serve_cuda_engine(
    address: str,
    specs: dict[str, tuple[tuple[int, ...], str]],
    refits: int,
    out: Queue[Any],
    timeout_s: float = 120.0,
) -> None:
    """Child process: serve ``refits`` colocated IPC refits (refit-zmq's receiver) into a
    :class:`CudaEngine`, then put its version and digests on ``out``."""
    from refit_zmq.ipc import IpcReceiver

    engine = CudaEngine(specs)
    receiver = IpcReceiver(engine, bind_address=address)
    try:
        for _ in range(refits):
            receiver.serve_refit(timeout_s=timeout_s)
    finally:
        receiver.close()
    out.put((engine.version, state_digest(engine.weights.items())))
