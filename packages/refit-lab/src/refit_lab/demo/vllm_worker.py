"""The worker extension of the demo's sparse vLLM engines: refit-zmq's, plus the digests of
the relay receiver's checkpoint-format shadow (what the engine's model was last loaded from).

vLLM repacks its own parameters (fused ``qkv_proj``, CPU kernel layouts), so only the
shadow can be compared bitwise with the trainer's weights. Start the engine with
``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

from typing import Any

from refit_core import RefitError
from refit_lab.digest import state_digest
from refit_zmq.vllm.worker import ZmqWorkerExtension

__all__ = ["WORKER_EXTENSION", "ShadowDigestExtension"]

WORKER_EXTENSION = "refit_lab.demo.vllm_worker.ShadowDigestExtension"


class ShadowDigestExtension(ZmqWorkerExtension):
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def refit_demo_shadow_digests(self) -> dict[str, int]:
        """Bitwise digests of the shadow the model was last pushed from, under checkpoint
        names.

        Raises:
            RefitError: the shadow holds a version the model was not given.
        """
        worker: Any = self
        shadow = getattr(worker.weight_transfer_engine, "shadow", None)
        if shadow is None:
            raise RefitError("no refit-zmq relay receiver (and shadow) in this worker")
        if shadow.pushed_version != shadow.version:
            raise RefitError(
                f"the shadow holds version {shadow.version}, the model {shadow.pushed_version}"
            )
        return state_digest(shadow.tensors.items())
