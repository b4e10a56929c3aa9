"""What refit's vLLM receivers share (refit-nccl's collective receiver, refit-zmq's IPC and
sparse receivers): holding an engine's requests while its weights are not one version, and
loading checkpoint-format tensors into a worker's model, staged or streamed.

Importing this package loads neither vLLM nor torch: :class:`VllmGate` drives an engine object
it is given (an offline ``vllm.LLM``, or an ``AsyncLLM`` through :class:`AsyncVllm`). The worker
modules (:mod:`~refit_core.vllm.loading`, :mod:`~refit_core.vllm.runtime_check`,
:mod:`~refit_core.vllm.write_map`) import torch and xxhash, which the ``vllm`` extra installs
(without them their import fails naming it); vLLM, the worker's own install, only where a load
runs.
"""

from refit_core.vllm.client import AsyncVllm, OfflineVllm, VllmClient, vllm_client
from refit_core.vllm.gate import VllmGate

__all__ = ["AsyncVllm", "OfflineVllm", "VllmClient", "VllmGate", "vllm_client"]
