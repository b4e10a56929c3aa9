"""The worker extension that carries refit-nccl's endpoint calls into a vLLM worker.

vLLM's native weight-update methods return nothing, while the collective synchronizer needs
answers (geometry, plan digests, transfer stats), so refit-nccl adds one worker method,
``refit_nccl_call``, taking one encoded call per worker rank (vLLM runs an RPC on every
worker of the engine at once) and returning bytes (:mod:`refit_nccl.vllm.calls`), plus
``refit_nccl_staging``, which polls a staging running on the worker's own thread. Start the
engine with ``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from refit_core import RefitError
from refit_core.backend import method_name
from refit_nccl.roles.contract import CollectiveEngineRole, CollectiveStagingRole, CommitStats
from refit_nccl.vllm.calls import decode_call, encode_reply

__all__ = ["CollectiveWorkerExtension"]

logger = logging.getLogger(__name__)

_TRANSFER = method_name(CollectiveEngineRole.refit_transfer)
_COMMIT = method_name(CollectiveEngineRole.refit_commit)
_STATUS = method_name(CollectiveEngineRole.refit_status)
_STAGE = method_name(CollectiveStagingRole.refit_stage)
_COMMIT_STAGED = method_name(CollectiveStagingRole.refit_commit_staged)
_DROP_STAGED = method_name(CollectiveStagingRole.refit_drop_staged)


class CollectiveWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker); vLLM refuses an extension
    whose attribute names clash with the worker's, hence the prefixed names."""

    def refit_nccl_call(self, requests: Sequence[bytes]) -> bytes:
        """Run this rank's call (``requests[rank]``) on its refit-nccl receiver; the reply as
        bytes, with whether the model now holds weights other than the version it serves."""
        from refit_nccl.vllm.engine import VllmCollectiveReceiver

        worker: Any = self
        receiver = worker.weight_transfer_engine
        partial = isinstance(receiver, VllmCollectiveReceiver) and receiver.partial
        try:
            if not isinstance(receiver, VllmCollectiveReceiver):
                raise RefitError(
                    "this worker's weight transfer engine is not refit-nccl's "
                    f"({type(receiver).__name__}); start vLLM with "
                    "weight_transfer_config={'backend': 'refit_nccl'}"
                )
            method, args = decode_call(requests[worker.rank])
            if method == _STAGE or (method == _TRANSFER and receiver.loading.staged):
                receiver.stage(*args)  # on a thread of its own: polled (refit_nccl_staging)
                result = None
            elif method == _TRANSFER:
                result = self._refit_nccl_session({"version": args[0], "timeout_s": args[1]})
            elif method == _COMMIT and receiver.loading.staged:
                result = self._refit_nccl_commit_staged(receiver, args[0]).version
            elif method == _COMMIT:
                result = receiver.endpoint.refit_commit(*args)
            elif method == _COMMIT_STAGED:
                result = self._refit_nccl_commit_staged(receiver, args[0])
            elif method == _DROP_STAGED:
                receiver.drop_staged()
                result = None
            elif method == _STATUS:
                result = receiver.status()
            else:
                result = getattr(receiver.endpoint, method)(*args)
            return encode_reply(result, partial=receiver.partial)
        except Exception as exc:
            logger.warning("refit-nccl call failed", exc_info=True)
            if isinstance(receiver, VllmCollectiveReceiver):
                partial = receiver.partial
            return encode_reply(error=exc, partial=partial)

    def refit_nccl_staging(self) -> bytes:
        """The outcome of this worker's staging (``pending`` while it runs), as a reply."""
        from refit_nccl.vllm.engine import VllmCollectiveReceiver

        worker: Any = self
        receiver = worker.weight_transfer_engine
        try:
            if not isinstance(receiver, VllmCollectiveReceiver):
                raise RefitError("this worker's weight transfer engine is not refit-nccl's")
            stats = receiver.staging_outcome()
            return encode_reply(stats, pending=stats is None)
        except Exception as exc:
            logger.warning("refit-nccl staging failed", exc_info=True)
            return encode_reply(error=exc)

    def _refit_nccl_commit_staged(self, receiver: Any, version: int) -> CommitStats:
        """Load the staged ``version`` into the model and serve it (the controller paused the
        engine); how long that took."""
        started = time.perf_counter()
        receiver.take_staged(version)
        self._refit_nccl_session({"version": version, "apply": True})
        receiver.endpoint.refit_commit(version)
        return CommitStats(version, time.perf_counter() - started)

    def _refit_nccl_session(self, update_info: dict[str, Any]) -> Any:
        """One call inside vLLM's own update session; the transfer's stats (or None)."""
        worker: Any = self
        worker.start_weight_update()
        worker.update_weights(update_info)
        worker.finish_weight_update()
        receiver = worker.weight_transfer_engine
        return None if update_info.get("apply") else receiver.transferred()
