"""The worker extension that carries refit-nccl's calls into a vLLM worker.

vLLM's native weight-update methods return nothing, while the collective synchronizer needs
answers (geometry, plan digests, transfer stats), so refit-nccl adds one worker method,
``refit_nccl_call``, taking one encoded call per worker rank (vLLM runs an RPC on every
worker of the engine at once, while each rank has a call of its own) and answering with an
encoded reply that never raises (:mod:`refit_core.worker_calls`). The calls are those of
:mod:`refit_nccl.vllm.calls`, run on the worker as a :class:`~refit_nccl.vllm.calls.VllmWorkerRole`.
Start the engine with ``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from refit_core import RefitError
from refit_core.backend import answer, encode
from refit_nccl.roles.contract import CommitStats, WorkerRefitStatus
from refit_nccl.roles.engine import EngineEndpoint
from refit_nccl.vllm.calls import EngineCall

if TYPE_CHECKING:
    from refit_nccl.transfer.stats import TransferStats
    from refit_nccl.vllm.engine import VllmCollectiveReceiver

__all__ = ["CollectiveWorkerExtension"]


class CollectiveWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker); vLLM refuses an extension
    whose attribute names clash with the worker's, hence the prefixed name."""

    def refit_nccl_call(self, requests: Sequence[bytes]) -> bytes:
        """Run this rank's call (``requests[rank]``) on its refit-nccl receiver; the reply as
        bytes, with whether the model now holds weights other than the version it serves."""
        worker: Any = self
        reply = answer(
            requests[worker.rank],
            EngineCall,
            lambda: _WorkerRole(worker),
            partial=lambda: _partial(worker),
        )
        return encode(reply)


def _receiver(worker: Any) -> VllmCollectiveReceiver:
    """The worker's refit-nccl receiver.

    Raises:
        RefitError: the worker's weight transfer engine is another one.
    """
    from refit_nccl.vllm.engine import VllmCollectiveReceiver

    receiver = worker.weight_transfer_engine
    if not isinstance(receiver, VllmCollectiveReceiver):
        raise RefitError(
            "this worker's weight transfer engine is not refit-nccl's "
            f"({type(receiver).__name__}); start vLLM with "
            "weight_transfer_config={'backend': 'refit_nccl'}"
        )
    return receiver


def _partial(worker: Any) -> bool:
    """Whether the worker's model holds weights other than the version it serves (never,
    without a refit-nccl receiver)."""
    from refit_nccl.vllm.engine import VllmCollectiveReceiver

    receiver = worker.weight_transfer_engine
    return isinstance(receiver, VllmCollectiveReceiver) and receiver.partial


class _WorkerRole:
    """One vLLM worker and its receiver as a :class:`~refit_nccl.vllm.calls.VllmWorkerRole`;
    the calls that write the model run inside vLLM's own update session."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._receiver = _receiver(worker)

    @property
    def endpoint(self) -> EngineEndpoint:
        return self._receiver.endpoint

    def transfer(self, version: int, timeout_s: float | None) -> TransferStats | None:
        if self._receiver.loading.staged:
            self.stage(version, timeout_s)
            return None
        self._session({"version": version, "timeout_s": timeout_s})
        return self._receiver.transferred()

    def stage(self, version: int, timeout_s: float | None) -> None:
        self._receiver.stage(version, timeout_s)  # on a thread of its own: polled

    def staging(self) -> TransferStats | None:
        return self._receiver.staging_outcome()

    def commit(self, version: int) -> int:
        if self._receiver.loading.staged:
            return self.commit_staged(version).version
        return self._receiver.endpoint.refit_commit(version)

    def commit_staged(self, version: int) -> CommitStats:
        started = time.perf_counter()
        self._receiver.take_staged(version)
        self._session({"version": version, "apply": True})
        self._receiver.endpoint.refit_commit(version)
        return CommitStats(version, time.perf_counter() - started)

    def drop_staged(self) -> None:
        self._receiver.drop_staged()

    def status(self) -> WorkerRefitStatus:
        return self._receiver.status()

    def _session(self, update_info: dict[str, Any]) -> None:
        """One ``update_weights`` inside vLLM's own update session."""
        self._worker.start_weight_update()
        self._worker.update_weights(update_info)
        self._worker.finish_weight_update()
