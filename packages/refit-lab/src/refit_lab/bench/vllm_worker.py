"""Worker extensions of ``refit bench vllm``: the references measured inside a vLLM worker
beside refit's receiver, and the worker's memory.

Each reference is vLLM's own code on the worker's model: ``load_checkpoint_weight_patches``
(``vllm/model_executor/model_loader/checkpoint_weight_patch.py``) with the same changed
elements as refit's delta, and a full reload of the state through vLLM's ``reload_weights``
(layerwise reload from tensors already in the worker's memory, so no disk read is timed).
Only vLLM workers import this module.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from refit_nccl.vllm.worker import CollectiveWorkerExtension
from refit_zmq.vllm.worker import ZmqWorkerExtension

__all__ = ["BenchCollectiveExtension", "BenchZmqExtension"]

logger = logging.getLogger(__name__)


def _memory() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


class _BenchMethods:
    """Mixed into vLLM's worker class with a refit extension (``self`` is the worker)."""

    _bench_states: dict[str, dict[str, torch.Tensor]]

    def refit_bench_load(self, paths: dict[str, str]) -> int:
        """Read the checkpoints of ``paths`` (state -> directory) into this worker's memory;
        their bytes."""
        from safetensors.torch import load_file  # type: ignore[import-not-found]  # vLLM brings it

        worker: Any = self
        dtype = worker.vllm_config.model_config.dtype
        self._bench_states = {
            state: {
                n: t.to(dtype) for n, t in load_file(os.path.join(p, "model.safetensors")).items()
            }
            for state, p in paths.items()
        }
        return sum(
            t.numel() * t.element_size() for t in next(iter(self._bench_states.values())).values()
        )

    def refit_bench_reload(self, state: str) -> float:
        """vLLM's full reload of ``state`` into the model; seconds."""
        worker: Any = self
        started = time.perf_counter()
        worker.reload_weights(weights_iterator=iter(self._bench_states[state].items()))
        return time.perf_counter() - started

    def refit_bench_patch(self, source: str, target: str) -> tuple[float | None, str | None]:
        """vLLM's ``load_checkpoint_weight_patches`` with the elements that differ between
        ``source`` and ``target`` (the model holds ``source``); seconds, or the error."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        worker: Any = self
        patches = []
        for name, new in self._bench_states[target].items():
            old = self._bench_states[source][name]
            changed = (old.view(torch.int16) != new.view(torch.int16)).reshape(-1).nonzero()
            indices = changed.reshape(-1)
            patches.append(
                CheckpointWeightPatch(
                    name, tuple(new.shape), new.dtype, new.reshape(-1)[indices], indices
                )
            )
        started = time.perf_counter()
        try:
            with set_current_vllm_config(worker.vllm_config):
                load_checkpoint_weight_patches(worker.get_model(), patches)
        except Exception as exc:
            logger.warning("vLLM's checkpoint patches failed: %s", exc)
            return None, f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - started, None

    def refit_bench_apply_s(self) -> float | None:
        """How long refit's receiver took to write the last refit into the model."""
        worker: Any = self
        value = getattr(worker.weight_transfer_engine, "last_apply_s", None)
        return None if value is None else float(value)

    def refit_bench_check_s(self) -> float | None:
        """How long the runtime check of refit's last load took (its digests of the received
        tensors while they arrived, and the check once loaded)."""
        worker: Any = self
        loading = getattr(worker.weight_transfer_engine, "loading", None)
        value = None if loading is None else loading.last_check_s
        return None if value is None else float(value)

    def refit_bench_memory(self, reset_peak: bool) -> dict[str, int]:
        """This worker's resident memory now and its peak (``VmRSS``, ``VmHWM``); with
        ``reset_peak`` the peak restarts from now (``/proc/self/clear_refs``)."""
        if reset_peak:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        return _memory()


class BenchZmqExtension(ZmqWorkerExtension, _BenchMethods):
    """refit-zmq's worker extension plus the bench's methods."""


class BenchCollectiveExtension(CollectiveWorkerExtension, _BenchMethods):
    """refit-nccl's worker extension plus the bench's methods."""
