"""The worker extension that tells the controller where a vLLM worker's refit-zmq receiver
listens.

vLLM's native weight-update methods return nothing, and receivers bind ephemeral ports, so
refit-zmq adds worker methods: ``refit_zmq_address`` (each worker's receiver) and
``refit_zmq_partial`` (whether its model holds weights other than the version it serves).
Start the engine with ``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

from typing import Any

from refit_core.errors import RefitError

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

    def refit_zmq_partial(self) -> bool:
        """Whether this worker's model holds weights other than the version it serves (a
        refit wrote it and none completed since).

        Raises:
            RefitError: the worker runs another weight-transfer engine.
        """
        worker: Any = self
        partial = getattr(worker.weight_transfer_engine, "partial", None)
        if not isinstance(partial, bool):
            raise RefitError("no refit-zmq receiver in this worker")
        return partial

    def refit_zmq_checkpoint_digests(self) -> dict[str, int]:
        """Bitwise digests of the checkpoint tensors as this worker's model holds them (the
        sparse receiver reads them back from the runtime parameters and its shadow).

        Raises:
            RefitError: no sparse receiver here, or it holds only slices (tensor parallel).
        """
        worker: Any = self
        digests = getattr(worker.weight_transfer_engine, "checkpoint_digests", None)
        if digests is None:
            raise RefitError("no refit-zmq sparse receiver in this worker")
        result: dict[str, int] = digests()
        return result
