"""refit-zmq inside vLLM: the sparse relay receiver as a vLLM weight-transfer engine.

Start each engine with :func:`engine_args`, then::

    generation = VllmRelayGeneration([llm])  # starts a relay in each worker
    sync = create_weight_synchronizer(trainer, generation, "vllm", False, train_cluster,
                                      inference_cluster, transport="zmq_sparse")

Importing this package does not import vLLM; :mod:`refit_zmq.vllm.engine` (built by vLLM in
each worker) does.
"""

from __future__ import annotations

from typing import Any

from refit_zmq.vllm.generation import VllmRelayGeneration

__all__ = ["BACKEND", "WORKER_EXTENSION", "VllmRelayGeneration", "engine_args"]

BACKEND = "refit_zmq_sparse"
"""The weight-transfer backend name refit-zmq's sparse receiver registers with vLLM."""

WORKER_EXTENSION = "refit_zmq.vllm.worker.ZmqWorkerExtension"
"""The worker extension that reports a receiver's address (``worker_extension_cls``)."""


def engine_args() -> dict[str, Any]:
    """The ``vllm.LLM`` / ``EngineArgs`` keywords that install refit-zmq's sparse receiver."""
    return {
        "weight_transfer_config": {"backend": BACKEND},
        "worker_extension_cls": WORKER_EXTENSION,
    }
