"""Packing geometry defaults, and the check against an installed vLLM's own defaults.

A receiver refit controls declares its geometry and both sides compare plan digests. A
receiver refit does not control (vLLM's native packed consumer behind Dynamo) packs with its
library's defaults; :func:`require_vllm_defaults` refuses a declared geometry that differs
from the installed vLLM's, so the two can never silently diverge.
"""

from __future__ import annotations

import importlib
import logging

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec

__all__ = [
    "DEFAULT_GEOMETRY",
    "VLLM_DOCUMENTED_GEOMETRY",
    "installed_vllm_geometry",
    "require_vllm_defaults",
]

logger = logging.getLogger(__name__)

_GiB = 1024**3

DEFAULT_GEOMETRY = CollectiveSenderSpec("refit", buffer_size_bytes=_GiB, num_buffers=2)
"""What a refit receiver declares unless told otherwise (buffers are trimmed to the plan)."""

VLLM_DOCUMENTED_GEOMETRY = CollectiveSenderSpec("vllm", buffer_size_bytes=_GiB, num_buffers=2)
"""vLLM's documented packed-transfer defaults (1 GiB x 2), used when vLLM is not installed."""

_VLLM_MODULE = "vllm.distributed.weight_transfer.packed_tensor"


def installed_vllm_geometry() -> CollectiveSenderSpec | None:
    """The packed-transfer defaults of the installed vLLM, or None when vLLM is absent."""
    try:
        module = importlib.import_module(_VLLM_MODULE)
    except ImportError:
        return None
    return CollectiveSenderSpec(
        "vllm",
        buffer_size_bytes=int(module.DEFAULT_PACKED_BUFFER_SIZE_BYTES),
        num_buffers=int(module.DEFAULT_PACKED_NUM_BUFFERS),
    )


def require_vllm_defaults(declared: CollectiveSenderSpec) -> CollectiveSenderSpec:
    """Check a vLLM receiver's declared geometry against the defaults it will really use.

    Returns the declared geometry. Compares with the installed vLLM where importable, else
    with :data:`VLLM_DOCUMENTED_GEOMETRY`.

    Raises:
        GeometryMismatchError: the declared geometry is not what the receiver packs with.
    """
    if declared.peer != "vllm":
        raise GeometryMismatchError(
            f"expected a vLLM receiver's geometry, got peer {declared.peer!r}"
        )
    installed = installed_vllm_geometry()
    reference = installed or VLLM_DOCUMENTED_GEOMETRY
    if declared != reference:
        source = "the installed vLLM" if installed else "vLLM's documented defaults"
        raise GeometryMismatchError(
            f"declared geometry {declared.buffer_size_bytes} B x {declared.num_buffers} differs "
            f"from {source} ({reference.buffer_size_bytes} B x {reference.num_buffers})"
        )
    return declared
