"""refit-zmq inside vLLM: the sparse relay receiver and the colocated IPC receiver, each a vLLM
weight-transfer engine.

Start each engine with :func:`engine_args` for the transport (any tensor-parallel size), then
hand the engines to the synchronizer through the matching generation::

    llm = LLM(model=path, tensor_parallel_size=2, **engine_args("zmq_sparse"))
    generation = VllmRelayGeneration([llm])  # starts a relay in each worker
    sync = create_weight_synchronizer(trainer, generation, "vllm", False, train_cluster,
                                      inference_cluster, transport="zmq_sparse")

    llm = LLM(model=path, **engine_args("ipc"))
    sync = create_weight_synchronizer(trainer, VllmIpcGeneration([llm]), "vllm", True)

LoRA adapters move from memory, one synchronizer per adapter, into engines started with
``enable_lora=True`` and :func:`engine_args` for ``"lora"``::

    llm = LLM(model=path, enable_lora=True, max_lora_rank=16, **engine_args("lora"))
    generation = VllmLoraGeneration([llm])
    sync = create_weight_synchronizer(adapter_policy, generation, "vllm", False,
                                      transport="lora", options=LoraOptions("math", 8, 16.0,
                                      ("q_proj", "v_proj")))
    sync.sync_weights()
    llm.generate(prompts, params, lora_request=generation.lora_request("math"))

A failed sparse refit leaves every engine on its previous version bit for bit; a failed IPC
refit leaves it on its previous version (staged, the default) or closed until a complete refit
(``staged=False``); the error's ``engines`` say which.

Importing this package does not import vLLM; the engine modules (built by vLLM in each
worker) do.
"""

from __future__ import annotations

from typing import Any, Literal

from refit_zmq.vllm.ipc_generation import VllmIpcGeneration
from refit_zmq.vllm.lora_generation import AdapterOnEngine, VllmLoraGeneration
from refit_zmq.vllm.relay_generation import VllmRelayGeneration

__all__ = [
    "BACKENDS",
    "WORKER_EXTENSION",
    "AdapterOnEngine",
    "VllmIpcGeneration",
    "VllmLoraGeneration",
    "VllmRelayGeneration",
    "engine_args",
]

BACKENDS = {
    "zmq_sparse": ("refit_zmq_sparse", "refit_zmq.vllm.relay_engine", "VllmRelayReceiver"),
    "ipc": ("refit_zmq_ipc", "refit_zmq.vllm.ipc_engine", "VllmIpcReceiver"),
}
"""Transport -> (weight-transfer backend name, module, class) refit-zmq registers with vLLM."""

WORKER_EXTENSION = "refit_zmq.vllm.worker.ZmqWorkerExtension"
"""The worker extension that reports a receiver's address, whether its model is partial, and
the sparse receiver's checkpoint digests (``worker_extension_cls``)."""


def engine_args(transport: Literal["zmq_sparse", "ipc", "lora"] = "zmq_sparse") -> dict[str, Any]:
    """The ``vllm.LLM`` / ``EngineArgs`` keywords that install refit-zmq's receiver for
    ``transport`` (an engine takes one; the LoRA calls come with either receiver, and
    ``"lora"`` alone needs none: add vLLM's own ``enable_lora=True``)."""
    if transport == "lora":
        return {"worker_extension_cls": WORKER_EXTENSION}
    backend, _, _ = BACKENDS[transport]
    return {
        "weight_transfer_config": {"backend": backend},
        "worker_extension_cls": WORKER_EXTENSION,
    }
