"""The worker extension that carries refit-zmq's calls into a vLLM worker.

Every call goes through one worker method, ``refit_zmq_call(method, *args)``, which never
raises: it answers ``(True, result)`` or ``(False, "Type: message")``. vLLM 0.32's multiprocess
executor stops reading replies at the first worker that raised, so with more than one worker a
raising RPC leaves the other workers' replies queued, and the next RPC reads them as its own.
The calls: vLLM's update-session steps (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``), and ``address`` (where
the worker's receiver listens: receivers bind ephemeral ports), ``partial`` (whether its model
holds weights other than the version it serves), ``placement`` (where the sparse receiver keeps
each checkpoint tensor) and ``checkpoint_digests`` (its read-back); and the ``lora_*`` calls
of the LoRA row (:mod:`refit_zmq.vllm.lora_worker`: adapters from memory). Start the engine
with ``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

import logging
from typing import Any

from refit_core import RefitError

__all__ = ["ZmqWorkerExtension"]

logger = logging.getLogger(__name__)

_SESSION = frozenset(
    {"init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"}
)


class ZmqWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def refit_zmq_call(self, method: str, *args: Any) -> tuple[bool, Any]:
        """Run ``method(*args)`` on this worker; ``(True, result)`` or ``(False, error)``."""
        worker: Any = self
        try:
            if method in _SESSION:
                return True, getattr(worker, method)(*args)
            if method.startswith("lora_"):
                from refit_zmq.vllm.lora_worker import lora_call

                return True, lora_call(worker, method, args)
            receiver = worker.weight_transfer_engine
            if method == "address":
                return True, _attribute(receiver, "address", str)
            if method == "partial":
                return True, _attribute(receiver, "partial", bool)
            if method == "versions":
                return True, _attribute(receiver, "versions", tuple)
            if method == "placement":
                placement = getattr(receiver, "placement", None)
                if placement is None:
                    raise RefitError("no refit-zmq sparse receiver in this worker")
                return True, placement()
            if method == "checkpoint_digests":
                digests = getattr(receiver, "checkpoint_digests", None)
                if digests is None:
                    raise RefitError("no refit-zmq sparse receiver in this worker")
                return True, digests()
            raise RefitError(f"{method!r} is not a refit-zmq worker call")
        except Exception as exc:
            logger.warning("refit-zmq worker call %s failed", method, exc_info=True)
            return False, f"{type(exc).__name__}: {exc}"


def _attribute(receiver: Any, name: str, kind: type) -> Any:
    value = getattr(receiver, name, None)
    if not isinstance(value, kind):
        raise RefitError(
            "no refit-zmq receiver in this worker: start vLLM with refit_zmq.vllm.engine_args() "
            "and call init_weight_transfer_engine"
        )
    return value
