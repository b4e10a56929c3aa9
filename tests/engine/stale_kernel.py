"""A module whose kernel stays on the old weights: how the engine tier shows that a refit whose
load leaves what a kernel computes with on the previous version fails, typed, with the engine
closed (vLLM's own reload leaves a tied output layer so; refit now processes it again, so the
fault is injected: one linear keeps its old CPU kernel whenever vLLM processes it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from refit_core import RefitError, VerificationError

STALE_MODULE = "model.layers.0.mlp.down_proj"


def _keep_kernel(worker: Any, module_name: str, keep: bool) -> None:
    """In a vLLM worker: from now on (``keep``), processing ``module_name`` again leaves it on
    the kernel it had; or back to vLLM's own processing."""
    module = worker.get_model().get_submodule(module_name)
    method = module.quant_method
    if not keep:
        del method.process_weights_after_loading
        return
    process = type(method).process_weights_after_loading

    def keeping(layer: Any) -> None:
        kernel = getattr(layer, "cpu_linear", None)
        process(method, layer)
        if layer is module:
            layer.cpu_linear = kernel

    method.process_weights_after_loading = keeping


@contextmanager
def stale_kernel(llm: Any, module_name: str = STALE_MODULE) -> Iterator[None]:
    """Every worker of ``llm`` keeps ``module_name``'s kernel inside the block."""
    llm.collective_rpc(_keep_kernel, args=(module_name, True))
    try:
        yield
    finally:
        llm.collective_rpc(_keep_kernel, args=(module_name, False))


def failed_verification(error: RefitError) -> bool:
    """Whether ``error`` is, or was caused by, a runtime check naming the stale module."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, VerificationError) and STALE_MODULE in str(cause):
            return True
        cause = cause.__cause__
    return False
