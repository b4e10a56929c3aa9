"""The packing geometry a Dynamo fleet of vLLM workers receives with."""

from __future__ import annotations

from refit_core.backend import CollectiveSenderSpec

__all__ = ["VLLM_SENDER_SPEC", "vllm_sender_spec"]

VLLM_SENDER_SPEC = CollectiveSenderSpec(peer="vllm", buffer_size_bytes=1 << 30, num_buffers=2)
"""vLLM's packed weight transfer defaults: 1 GiB buffers, 2 in flight."""


def vllm_sender_spec() -> CollectiveSenderSpec:
    """:data:`VLLM_SENDER_SPEC`, checked against vLLM's own defaults when vLLM is importable.

    Raises:
        GeometryMismatchError: the installed vLLM packs with other defaults.
    """
    from refit_nccl.backend import require_vllm_defaults

    return require_vllm_defaults(VLLM_SENDER_SPEC)
