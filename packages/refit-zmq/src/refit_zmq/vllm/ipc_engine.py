"""The colocated IPC receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` as ``refit_zmq_ipc`` by refit-zmq's
``vllm.general_plugins`` entry point (:data:`~refit_zmq.vllm.BACKENDS`).
``init_weight_transfer_engine`` binds an :class:`~refit_zmq.ipc.IpcReceiver` over the worker's
model; each refit is one vLLM update session: ``start_weight_update`` opens vLLM's layerwise
reload, ``update_weights({"timeout_s"})`` serves the trainer's control socket until the refit
commits or aborts (loading each bucket from the shared buffers into the model), and
``finish_weight_update`` processes the layers into vLLM's kernel layout. As with every IPC
receiver nothing is rolled back: a refit that fails after loading started leaves the receiver
``partial`` until the next (dense) refit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from refit_core import RefitError
from refit_core.backend import checkpoint_specs, dtype_name
from refit_zmq.ipc import IpcReceiver

__all__ = ["IpcInitInfo", "IpcUpdateInfo", "VllmIpcReceiver"]

logger = logging.getLogger(__name__)


@dataclass
class IpcInitInfo:
    """``init_weight_transfer_engine`` arguments: where the control socket binds."""

    bind_address: str = "tcp://127.0.0.1:*"


@dataclass
class IpcUpdateInfo:
    """``update_weights`` arguments: serve one refit within ``timeout_s`` (None: no limit)."""

    timeout_s: float | None = None


class _WorkerModel:
    """The worker's model as the :class:`~refit_zmq.ipc.IpcEngine` the receiver loads."""

    def __init__(self, receiver: VllmIpcReceiver) -> None:
        self._receiver = receiver

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        # Layerwise reload keeps a layer's tensors until the layer is complete, and the shared
        # buffer is refilled once this call returns: hand it copies.
        return self._receiver.model.load_weights([(n, t.clone()) for n, t in weights])

    def set_weight_version(self, version: int) -> None:
        logger.info("ipc: version %d loaded", version)

    def reset_prefix_cache(self) -> None:
        """Nothing to drop here: the prefix cache lives in vLLM's scheduler, which the
        controller resets after the session (:class:`~refit_zmq.vllm.VllmIpcGeneration`)."""

    def checkpoint_tensor_specs(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        config = self._receiver.model_config
        return checkpoint_specs(config.model, dtype_name(config.dtype))


class VllmIpcReceiver(WeightTransferEngine):  # type: ignore[misc]
    """refit-zmq's colocated IPC receiver in one vLLM worker."""

    init_info_cls = IpcInitInfo
    update_info_cls = IpcUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: IpcReceiver | None = None
        self.address: str | None = None
        self._reloading = False

    def init_transfer_engine(self, init_info: IpcInitInfo) -> None:
        """(Re)bind the control socket; the version carries over."""
        version = 0 if self.receiver is None else self.receiver.version
        self.shutdown()
        self.receiver = IpcReceiver(
            _WorkerModel(self), bind_address=init_info.bind_address, version=version
        )
        self.address = self.receiver.address
        logger.info("ipc receiver at %s (version %d)", self.address, version)

    def start_weight_update(self) -> None:
        """Put the model into layerwise reload."""
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def receive_weights(self, update_info: IpcUpdateInfo) -> None:
        """Serve one refit; a failure ends the reload at once (vLLM will not call
        ``finish_weight_update``)."""
        try:
            if self.receiver is None:
                raise RefitError("the IPC receiver was never bound (init_weight_transfer_engine)")
            self.receiver.serve_refit(update_info.timeout_s)
        except BaseException:
            self.finish_weight_update()
            raise

    def finish_weight_update(self) -> None:
        """Process the loaded layers into vLLM's kernel layout."""
        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Close the control socket."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
