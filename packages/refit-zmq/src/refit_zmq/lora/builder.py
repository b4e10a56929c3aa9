"""The factory's builder of the (vllm, colocated / non-colocated, ``lora``) rows."""

from __future__ import annotations

from refit_core.backend import PolicyLike, SynchronizerRequest
from refit_zmq.lora.options import LoraOptions
from refit_zmq.lora.synchronizer import LoraGeneration, LoraWeightSynchronizer

__all__ = ["build_lora_synchronizer"]


def build_lora_synchronizer(request: SynchronizerRequest) -> LoraWeightSynchronizer:
    """The factory's builder for (vllm, *, lora): ``policy`` yields the adapter's tensors,
    ``generation`` is a :class:`~refit_zmq.vllm.VllmLoraGeneration`, ``options`` a
    :class:`LoraOptions` (required: it names the adapter).

    Raises:
        ValueError: a policy without ``weight_source()``, a generation that holds no adapters,
            no options, or a ``refit_buffer_size_gb`` (the row sends the adapter whole).
    """
    if not isinstance(request.policy, PolicyLike):
        raise ValueError("policy must provide weight_source() (the adapter's tensors)")
    if not isinstance(request.generation, LoraGeneration):
        raise ValueError("generation must be a VllmLoraGeneration (engines with enable_lora=True)")
    options = request.options_as(LoraOptions)
    if options is None:
        raise ValueError("the lora row needs options=LoraOptions(adapter=..., rank=..., ...)")
    if request.refit_buffer_size_gb is not None:
        raise ValueError("the lora row sends each adapter version whole: no refit_buffer_size_gb")
    return LoraWeightSynchronizer(
        request.policy, request.generation, options, refit_timeout_s=request.refit_timeout_s
    )
