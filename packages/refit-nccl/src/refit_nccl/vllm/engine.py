"""The packed-collective receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` under :data:`~refit_nccl.vllm.BACKEND` by the
``vllm.general_plugins`` entry point of refit-nccl, so an engine started with
``weight_transfer_config={"backend": "refit_nccl"}`` builds one in each worker. It holds an
:class:`~refit_nccl.endpoint.EngineEndpoint` whose engine is the worker's model: each refit
runs inside vLLM's own update session (``start_weight_update`` -> ``update_weights`` ->
``finish_weight_update``), which wraps the transfer in vLLM's layerwise reload, because a
plain ``load_weights`` cannot write the repacked parameters once the engine has started.
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
from refit_core.backend import CollectiveSenderSpec, checkpoint_specs, dtype_name
from refit_nccl.broadcast import TransferStats
from refit_nccl.endpoint import EngineEndpoint
from refit_nccl.geometry import DEFAULT_GEOMETRY

__all__ = ["CollectiveInitInfo", "CollectiveUpdateInfo", "VllmCollectiveReceiver"]

logger = logging.getLogger(__name__)


@dataclass
class CollectiveInitInfo:
    """``init_weight_transfer_engine`` arguments: the packing geometry this worker declares."""

    buffer_size_bytes: int = DEFAULT_GEOMETRY.buffer_size_bytes
    num_buffers: int = DEFAULT_GEOMETRY.num_buffers


@dataclass
class CollectiveUpdateInfo:
    """``update_weights`` arguments: receive ``version`` within ``timeout_s`` (None: disarmed)."""

    version: int
    timeout_s: float | None = None


class _WorkerModel:
    """The worker's model as a :class:`~refit_nccl.endpoint.CollectiveEngine`."""

    def __init__(self, receiver: VllmCollectiveReceiver) -> None:
        self._receiver = receiver
        self.weight_version = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        # Layerwise reload keeps a layer's tensors until the layer is complete, and a bucket's
        # views are reused once this call returns: hand it copies.
        return self._receiver.model.load_weights([(n, t.clone()) for n, t in weights])

    def reset_prefix_cache(self) -> None:
        """Nothing to drop here: the prefix cache lives in vLLM's scheduler, which the
        controller resets after the commit (see :class:`~refit_nccl.vllm.VllmEngineParticipant`)."""

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    def checkpoint_tensor_specs(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        config = self._receiver.model_config
        return checkpoint_specs(config.model, dtype_name(config.dtype))


class VllmCollectiveReceiver(WeightTransferEngine):  # type: ignore[misc]
    """refit-nccl's receiver in one vLLM worker (built by vLLM, reached through
    :class:`~refit_nccl.vllm.worker.CollectiveWorkerExtension`)."""

    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.endpoint = EngineEndpoint(lambda: _WorkerModel(self), DEFAULT_GEOMETRY)
        self.last_stats: TransferStats | None = None
        self._reloading = False

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Declare another packing geometry (leaves any current group)."""
        geometry = CollectiveSenderSpec("refit", init_info.buffer_size_bytes, init_info.num_buffers)
        self.endpoint.refit_abort("geometry changed")
        self.endpoint = EngineEndpoint(lambda: _WorkerModel(self), geometry)
        logger.info("refit-nccl receiver: geometry %s", geometry)

    def start_weight_update(self) -> None:
        """Put the model into layerwise reload."""
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        """Receive one refit through the endpoint's group.

        A failed transfer ends the reload at once (vLLM will not call
        ``finish_weight_update``): layers fully received keep the new values, the others
        their old ones, and the endpoint stays dirty until the next complete refit.
        """
        self.last_stats = None
        try:
            self.last_stats = self.endpoint.refit_transfer(
                update_info.version, update_info.timeout_s
            )
        except BaseException:
            self.finish_weight_update()
            raise

    def finish_weight_update(self) -> None:
        """Process the received layers into vLLM's kernel layout."""
        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def transferred(self) -> TransferStats:
        """The stats of the transfer that just finished.

        Raises:
            RefitError: no transfer completed.
        """
        if self.last_stats is None:
            raise RefitError("no transfer completed in this update session")
        return self.last_stats

    def shutdown(self) -> None:
        """Leave the group (never blocks)."""
        self.endpoint.refit_abort("weight transfer engine shut down")
