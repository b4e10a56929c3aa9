"""The worker extension that tells the controller where a vLLM worker's refit-zmq receiver
listens.

vLLM's native weight-update methods return nothing, and receivers bind ephemeral ports, so
refit-zmq adds one worker method, ``refit_zmq_address``. Start the engine with
``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

from typing import Any

from refit_core import RefitError

__all__ = ["ZmqWorkerExtension"]


class ZmqWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def refit_zmq_address(self) -> str:
        """The address of this worker's refit-zmq receiver.

        Raises:
            RefitError: the worker runs another weight-transfer engine, or none started yet.
        """
        worker: Any = self
        address = getattr(worker.weight_transfer_engine, "address", None)
        if not isinstance(address, str):
            raise RefitError(
                "no refit-zmq receiver in this worker: start vLLM with "
                "refit_zmq.vllm.engine_args() and call init_weight_transfer_engine"
            )
        return address
