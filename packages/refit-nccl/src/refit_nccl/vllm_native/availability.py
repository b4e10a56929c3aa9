"""Whether vLLM's own NCCL weight-transfer helpers can be used in this process.

A group on vLLM's rendezvous with the ``nccl`` backend is built with vLLM's own code
(``StatelessProcessGroup``, ``PyNcclCommunicator``, the weight-transfer dataclasses), so the
trainer needs vLLM importable; where it is not, refit refuses with the install line instead
of building a communicator of its own that vLLM's receiver might not match.
"""

from __future__ import annotations

import functools
import importlib

from refit_core import BackendNotInstalledError

__all__ = ["VLLM_INSTALL_HINT", "VLLM_NCCL_MODULES", "require_vllm_nccl", "vllm_nccl_missing"]

VLLM_INSTALL_HINT = "pip install vllm  (the vLLM release the engines run)"

VLLM_NCCL_MODULES = (
    "vllm.distributed.utils",
    "vllm.distributed.device_communicators.pynccl",
    "vllm.distributed.weight_transfer.nccl_engine",
)
"""vLLM's trainer-side helpers refit uses: rendezvous, communicator, init and update info."""


@functools.cache
def vllm_nccl_missing() -> str:
    """Why vLLM's NCCL weight-transfer helpers cannot be imported here ("" when they can)."""
    for name in VLLM_NCCL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return (
                f"vLLM's NCCL data plane is built with vLLM's code; {name} does not import: {exc}"
            )
    return ""


def require_vllm_nccl() -> None:
    """Raise unless vLLM's NCCL weight-transfer helpers import.

    Raises:
        BackendNotInstalledError: they do not; the message names what to install.
    """
    missing = vllm_nccl_missing()
    if missing:
        raise BackendNotInstalledError(
            f"an engine on vLLM's NCCL weight transfer needs vLLM on the trainer: {missing}",
            install_hint=VLLM_INSTALL_HINT,
        )
