"""The worker extension that carries refit-nccl's endpoint calls into a vLLM worker.

vLLM's native weight-update methods return nothing, while the collective synchronizer needs
answers (geometry, plan digests, transfer stats), so refit-nccl adds one worker method,
``refit_nccl_call``, taking and returning bytes (:mod:`refit_nccl.vllm.calls`). Start the
engine with ``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

import logging
from typing import Any

from refit_core import RefitError
from refit_core.backend import method_name
from refit_nccl.roles import CollectiveEngineRole
from refit_nccl.vllm.calls import decode_call, encode_reply

__all__ = ["CollectiveWorkerExtension"]

logger = logging.getLogger(__name__)

_TRANSFER = method_name(CollectiveEngineRole.refit_transfer)


class CollectiveWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker); vLLM refuses an extension
    whose attribute names clash with the worker's, hence the prefixed names."""

    def refit_nccl_call(self, request: bytes) -> bytes:
        """Run one endpoint call on this worker's refit-nccl receiver; the reply as bytes."""
        try:
            from refit_nccl.vllm.engine import VllmCollectiveReceiver

            worker: Any = self
            receiver = worker.weight_transfer_engine
            if not isinstance(receiver, VllmCollectiveReceiver):
                raise RefitError(
                    "this worker's weight transfer engine is not refit-nccl's "
                    f"({type(receiver).__name__}); start vLLM with "
                    "weight_transfer_config={'backend': 'refit_nccl'}"
                )
            method, args = decode_call(request)
            if method == _TRANSFER:
                return encode_reply(self._refit_nccl_transfer(receiver, *args))
            return encode_reply(getattr(receiver.endpoint, method)(*args))
        except Exception as exc:
            logger.warning("refit-nccl call failed", exc_info=True)
            return encode_reply(error=exc)

    def _refit_nccl_transfer(self, receiver: Any, version: int, timeout_s: float | None) -> Any:
        """One transfer inside vLLM's own update session (layerwise reload around it)."""
        worker: Any = self
        worker.start_weight_update()
        worker.update_weights({"version": version, "timeout_s": timeout_s})
        worker.finish_weight_update()
        return receiver.transferred()
