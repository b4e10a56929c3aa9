"""vLLM's own NCCL weight transfer, driven by refit: the trainer's communicator is vLLM's
``PyNcclCommunicator`` (built with vLLM's rendezvous, with refit's deadline and abort,
:mod:`~refit_nccl.vllm_native.communicator`), the trainer rank speaks vLLM's protocol
(:mod:`~refit_nccl.vllm_native.trainer`, also for Dynamo workers), and unmodified engines are
driven through vLLM's weight-sync surface (:mod:`~refit_nccl.vllm_native.engine`;
``VllmNativeGeneration`` is also exported by ``refit_nccl``).

Importing this package does not import vLLM; building a communicator or a payload does, and
refuses with the install line where vLLM is missing.
"""

from __future__ import annotations

from refit_nccl.vllm_native.availability import (
    VLLM_INSTALL_HINT,
    require_vllm_nccl,
    vllm_nccl_missing,
)
from refit_nccl.vllm_native.payloads import nccl_init_info, nccl_update_info

__all__ = [
    "VLLM_INSTALL_HINT",
    "nccl_init_info",
    "nccl_update_info",
    "require_vllm_nccl",
    "vllm_nccl_missing",
]
