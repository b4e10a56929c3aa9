"""A module whose kernel stays on the old weights: how the engine tier shows that a refit whose
load leaves what a kernel computes with on the previous version fails, typed, with the engine
closed (vLLM's own reload leaves a tied output layer so; refit now processes it again, so the
fault is injected: one linear keeps its old CPU kernel whenever it is processed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from refit_core import RefitError, VerificationError

STALE_MODULE = "model.layers.0.mlp.down_proj"


def _keep_kernel(worker: Any, module_name: str, keep: bool) -> None:
    """In a vLLM worker: from now on (``keep``), ``module_name`` keeps the kernel it has
    whatever processes it (its class gains a ``cpu_linear`` that ignores new kernels); or back
    to its own class, on the kernel it kept until it is processed again."""
    module = worker.get_model().get_submodule(module_name)
    kernel = module.cpu_linear
    if not keep:
        module.__class__ = module.refit_test_class
        module.cpu_linear = kernel
        return
    original = type(module)
    del module.cpu_linear
    module.__class__ = type(
        f"Stale{original.__name__}",
        (original,),
        {
            "cpu_linear": property(lambda _: kernel, lambda _, new: None),
            "refit_test_class": original,
        },
    )


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
