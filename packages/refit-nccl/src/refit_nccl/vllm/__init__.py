"""refit-nccl inside vLLM: the packed-collective receiver as a vLLM weight-transfer engine.

Start each engine with :func:`engine_args` (any tensor-parallel size), then hand the engines
to the synchronizer::

    llm = LLM(model=path, tensor_parallel_size=2, **engine_args())
    sync = create_weight_synchronizer(trainer, VllmCollectiveGeneration([llm]), "vllm", False,
                                      train_cluster, inference_cluster, refit_timeout_s=60)

Every worker joins the refit group and receives the checkpoint tensors whole; a failed refit
leaves each engine on its old version (staged, the default) or closed until a complete refit
(``staged=False``), and the error's ``engines`` say which.

Importing this package does not import vLLM; :mod:`refit_nccl.vllm.engine` (built by vLLM
in each worker) does.
"""

from __future__ import annotations

from typing import Any

from refit_nccl.vllm.participant import VllmCollectiveGeneration, VllmWorkerParticipant

__all__ = [
    "BACKEND",
    "WORKER_EXTENSION",
    "VllmCollectiveGeneration",
    "VllmWorkerParticipant",
    "engine_args",
]

BACKEND = "refit_nccl"
"""The weight-transfer backend name refit-nccl registers with vLLM."""

WORKER_EXTENSION = "refit_nccl.vllm.worker.CollectiveWorkerExtension"
"""The worker extension that carries the endpoint calls (``worker_extension_cls``)."""


def engine_args() -> dict[str, Any]:
    """The ``vllm.LLM`` / ``EngineArgs`` keywords that install refit-nccl's receiver."""
    return {
        "weight_transfer_config": {"backend": BACKEND},
        "worker_extension_cls": WORKER_EXTENSION,
    }
