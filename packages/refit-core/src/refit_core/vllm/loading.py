"""Checkpoint-format tensors into one vLLM worker's model, staged or streamed.

vLLM repacks parameters at load (fused ``qkv_proj``, kernel layouts), so checkpoint tensors
reach a running model only through its layerwise reload: the layers go back to checkpoint
shapes, each layer is loaded and processed once all of its tensors arrived, and the result is
copied into the kernel tensors. A layer loaded in part cannot be undone, so:

- **staged** (default): every tensor is copied to host memory as it arrives (or kept where the
  receiver received it, when that memory stays valid until the refit completes) and nothing
  touches the model until the refit is complete; then one reload session loads them all. A
  refit that fails before then leaves the model exactly as it was. Memory: one host copy of
  the checkpoint tensors this worker receives (buffers kept for the next refit).
- **streamed**: each bucket goes into the reload session as it arrives. No extra memory
  beyond a layer's tensors, but from the first bucket until the refit completes the model
  holds weights of no single version (:attr:`CheckpointLoading.partial`), so the engine must
  stay closed (:class:`~refit_core.vllm.VllmGate`) until a later complete refit.

Every load ends with the worker's :class:`~refit_core.vllm.runtime_check.RuntimeCheck`: the
modules vLLM's reload leaves stale (a tied ``lm_head``) are processed again, every parameter the
load wrote is checked whole against the refit's tensors (digests) and what the kernels read at
probed positions; a load that leaves any of it on other values raises
:class:`~refit_core.errors.VerificationError` (the model stays :attr:`partial`).

Only a vLLM worker uses this module. It imports torch (the ``vllm`` extra installs it) and
vLLM's reload only where a load runs (vLLM is the worker's own install).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from refit_core.backend import checkpoint_specs, dtype_name
from refit_core.extras import missing_extra

try:  # the `vllm` extra installs it
    import torch
except ModuleNotFoundError as missing:
    raise missing_extra(__name__, missing, "vllm") from missing

from refit_core.vllm.runtime_check import RuntimeCheck
from refit_core.vllm.write_map import WriteMap, capture_write_map

__all__ = [
    "CheckpointLoading",
    "LoadingReceiver",
    "ModelHolder",
    "release_freed_host_memory",
    "runtime_check",
]

logger = logging.getLogger(__name__)


class ModelHolder(Protocol):
    """What owns the model a refit loads into (vLLM's ``WeightTransferEngine`` does)."""

    model: Any
    model_config: Any


def runtime_check(holder: ModelHolder, found: WriteMap | None = None) -> RuntimeCheck:
    """The runtime check of ``holder``'s model, from its write map (captured here from the
    engine's checkpoint unless given).

    Raises:
        RefitError: the model cannot be kept exact (see :class:`RuntimeCheck`).
        RuntimeError: the model's loader cannot run on meta tensors.
    """
    if found is None:
        config = holder.model_config
        specs = {
            name: (shape, getattr(torch, dtype))
            for name, (shape, dtype) in checkpoint_specs(
                config.model, dtype_name(config.dtype)
            ).items()
        }
        found = capture_write_map(holder.model, specs)
    return RuntimeCheck(holder.model, found)


def release_freed_host_memory() -> None:
    """Give the host memory a load freed back to the system (glibc's ``malloc_trim``; nothing
    under another allocator). vLLM's layerwise reload allocates every layer anew and builds
    new CPU kernels, a few MB each: glibc keeps such freed blocks in the heap, so without this
    a 1 GB model's worker kept about 0.3 GB more after every refit."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


class CheckpointLoading:
    """One worker's loads of checkpoint tensors, one refit at a time.

    Args:
        holder: the worker's weight-transfer engine (its current ``model`` and config).
        staged: stage in host memory until :meth:`complete` (see the module docstring).
    """

    def __init__(self, holder: ModelHolder, *, staged: bool) -> None:
        self._holder = holder
        self.staged = staged
        self.check: RuntimeCheck | None = None
        """Run around every load (set by the receiver once it started:
        :func:`runtime_check`)."""
        self.partial = False
        """Whether the model holds weights other than the version it serves (a load began
        and no refit was committed since)."""
        self.last_load_s: float | None = None
        """How long the last :meth:`complete` took (the staged load, or the reload's end, and
        the runtime check)."""
        self.last_check_s: float | None = None
        """How long the runtime check of the last load took (part of :attr:`last_load_s`)."""
        self._host: dict[str, torch.Tensor] = {}
        self._borrowed: dict[str, torch.Tensor] = {}
        self._received: list[str] = []
        self._reloading = False

    @property
    def staged_bytes(self) -> int:
        """Host memory the staging buffers hold."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

    def begin(self) -> None:
        """Start a refit: forget what an unfinished one received."""
        self._received = []
        self._borrowed = {}
        self._runtime_check().begin()

    def _runtime_check(self) -> RuntimeCheck:
        if self.check is None:
            raise RuntimeError("the receiver never built its runtime check")
        return self.check

    def take(self, weights: Iterable[tuple[str, torch.Tensor]], *, copy: bool = True) -> None:
        """One bucket's tensors, valid only during this call (``copy``) or until the refit
        completes (staged, they are then kept as they are: host memory the caller lends, no
        copy)."""
        check = self._runtime_check()
        if self.staged:
            for name, tensor in weights:
                check.expect(name, tensor)
                if copy:
                    self._stage(name, tensor)
                else:
                    self._host.pop(name, None)
                    self._borrowed[name] = tensor
                self._received.append(name)
            return
        if not self._reloading:
            self._start_reload()
        self.partial = True
        # The reload keeps a layer's tensors until the layer is complete, while a caller may
        # reuse its buffers once this returns.
        taken = [(n, t.clone() if copy else t) for n, t in weights]
        for name, tensor in taken:
            check.expect(name, tensor)
        self._holder.model.load_weights(taken)

    def _stage(self, name: str, tensor: torch.Tensor) -> None:
        held = self._host.get(name)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            self._host[name] = held
        held.copy_(tensor)

    def complete(self) -> None:
        """The refit is complete: load what was staged (staged) or finish the reload session
        (streamed), then run the runtime check. The model holds the refit's weights once this
        returns (still :attr:`partial` until :meth:`committed`).

        Raises:
            VerificationError: the model or its kernels hold other values than the refit's
                after the load (the model stays :attr:`partial`).
        """
        started = time.perf_counter()
        loaded = self._reloading
        if self.staged and self._received:
            self._start_reload()
            loaded = True
            self.partial = True
            try:
                staged = {**self._host, **self._borrowed}
                self._holder.model.load_weights([(n, staged[n]) for n in self._received])
            finally:
                self._finish()
            logger.info("loaded %d staged tensors", len(self._received))
        else:
            self._finish()
        self._received = []
        self._borrowed = {}
        checked = time.perf_counter()
        if loaded:
            self._runtime_check().finish()
        self.last_check_s = time.perf_counter() - checked
        if loaded:
            release_freed_host_memory()
        self.last_load_s = time.perf_counter() - started

    def committed(self) -> None:
        """The loaded refit is the version the engine serves now."""
        self.partial = False

    def abandon(self) -> None:
        """The refit failed: drop what was staged (the model is untouched), or end the reload
        session (the model stays :attr:`partial` if anything was loaded)."""
        self._received = []
        self._borrowed = {}
        self._finish()

    # vLLM is the worker's own install (no extra of refit-core brings it): its reload is
    # imported where a load runs, so this module imports in any process with the extra.
    def _start_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self._holder.model)
        self._reloading = True

    def _finish(self) -> None:
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self._holder.model, self._holder.model_config)


class LoadingReceiver:
    """Mixed into a weight-transfer engine that loads through ``self.loading``: what it
    reports about the model."""

    loading: CheckpointLoading

    @property
    def partial(self) -> bool:
        """Whether the model holds weights other than the version it serves."""
        return self.loading.partial

    @property
    def last_apply_s(self) -> float | None:
        """How long writing the last refit into the model took."""
        return self.loading.last_load_s
