"""Child-process targets of the GPU test (importable by name, as spawn needs)."""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

from refit_lab.cuda_engine import CudaEngine
from refit_lab.digest import state_digest
from refit_zmq.ipc import IpcReceiver


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
