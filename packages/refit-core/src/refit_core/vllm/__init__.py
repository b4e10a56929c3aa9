"""What refit's vLLM receivers share (refit-nccl's collective receiver, refit-zmq's IPC and
sparse receivers): holding an engine's requests while its weights are not one version, and
loading checkpoint-format tensors into a worker's model, staged or streamed.

Importing this package loads neither vLLM nor torch: :class:`VllmGate` drives an engine object
it is given (an offline ``vllm.LLM``, or an ``AsyncLLM`` through :class:`AsyncVllm`), and
:mod:`refit_core.vllm.loading` imports them only inside a vLLM worker.
"""

from refit_core.vllm.client import AsyncVllm, OfflineVllm, VllmClient, vllm_client
from refit_core.vllm.gate import VllmGate

__all__ = ["AsyncVllm", "OfflineVllm", "VllmClient", "VllmGate", "vllm_client"]
