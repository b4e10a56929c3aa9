"""The packed-collective receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` under :data:`~refit_nccl.vllm.BACKEND` by the
``vllm.general_plugins`` entry point of refit-nccl, so an engine started with
``weight_transfer_config={"backend": "refit_nccl"}`` builds one in each worker (every tensor
parallel rank). It holds an :class:`~refit_nccl.endpoint.EngineEndpoint` whose engine is the
worker's model. Each rank joins the refit group as a rank of its own and receives every
checkpoint tensor whole; vLLM's loader keeps the rank's slice.

Buckets reach the model through :class:`~refit_core.vllm.loading.CheckpointLoading`: staged
(default) in host memory and loaded at the commit, so a transfer that fails leaves the model
untouched, or streamed into vLLM's layerwise reload as they arrive, so a transfer that fails
after its first bucket leaves the model partial (the controller keeps such an engine closed).
Every call runs inside vLLM's own update session (``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit_core import RefitError
from refit_core.backend import CollectiveSenderSpec, checkpoint_specs, dtype_name
from refit_core.vllm.loading import CheckpointLoading, LoadingReceiver
from refit_nccl.broadcast import TransferStats
from refit_nccl.endpoint import EngineEndpoint
from refit_nccl.geometry import DEFAULT_GEOMETRY

__all__ = ["CollectiveInitInfo", "CollectiveUpdateInfo", "VllmCollectiveReceiver"]

logger = logging.getLogger(__name__)


@dataclass
class CollectiveInitInfo:
    """``init_weight_transfer_engine`` arguments: the packing geometry this worker declares and
    whether buckets are staged in host memory until the commit."""

    buffer_size_bytes: int = DEFAULT_GEOMETRY.buffer_size_bytes
    num_buffers: int = DEFAULT_GEOMETRY.num_buffers
    staged: bool = True


@dataclass
class CollectiveUpdateInfo:
    """``update_weights`` arguments: receive ``version`` within ``timeout_s`` (None: disarmed),
    or, with ``apply``, load the staged ``version`` into the model."""

    version: int
    timeout_s: float | None = None
    apply: bool = False


class _WorkerModel:
    """The worker's model as a :class:`~refit_nccl.endpoint.CollectiveEngine`."""

    def __init__(self, receiver: VllmCollectiveReceiver) -> None:
        self._receiver = receiver
        self.weight_version = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        self._receiver.loading.take(weights)
        return None

    def reset_prefix_cache(self) -> None:
        """Nothing to drop here: the prefix cache lives in vLLM's scheduler, which the
        controller resets when it reopens the engine (:class:`~refit_core.vllm.VllmGate`)."""

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version
        self._receiver.loading.committed()

    def checkpoint_tensor_specs(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        config = self._receiver.model_config
        return checkpoint_specs(config.model, dtype_name(config.dtype))


class VllmCollectiveReceiver(LoadingReceiver, WeightTransferEngine):  # type: ignore[misc]
    """refit-nccl's receiver in one vLLM worker (built by vLLM, reached through
    :class:`~refit_nccl.vllm.worker.CollectiveWorkerExtension`)."""

    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.endpoint = EngineEndpoint(
            lambda: _WorkerModel(self), DEFAULT_GEOMETRY, can_stage=False
        )
        self.loading = CheckpointLoading(self, staged=True)
        self.last_stats: TransferStats | None = None

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Declare a packing geometry and the staging mode (leaves any current group)."""
        geometry = CollectiveSenderSpec("refit", init_info.buffer_size_bytes, init_info.num_buffers)
        self.endpoint.refit_abort("geometry changed")
        # vLLM's model is written through its layerwise reload (``self.loading``), which the
        # endpoint's refit_stage does not drive: this worker does not stage (yet).
        self.endpoint = EngineEndpoint(lambda: _WorkerModel(self), geometry, can_stage=False)
        self.loading.abandon()
        self.loading.staged = init_info.staged
        logger.info("refit-nccl receiver: geometry %s, staged %s", geometry, init_info.staged)

    def start_weight_update(self) -> None:
        """Nothing to prepare: loading opens vLLM's layerwise reload when the model is first
        written."""

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        """Receive one refit through the endpoint's group, or load a staged one (``apply``).

        A failed transfer drops what was staged (the model is untouched), or, streamed, ends
        the reload at once with the model partial until the next complete refit.
        """
        if update_info.apply:
            self._apply(update_info.version)
            return
        self.last_stats = None
        self.loading.begin()
        try:
            stats = self.endpoint.refit_transfer(update_info.version, update_info.timeout_s)
            if not self.loading.staged:
                self.loading.complete()
        except BaseException:
            self.loading.abandon()
            raise
        self.last_stats = stats

    def _apply(self, version: int) -> None:
        loaded = self.endpoint.refit_status().loaded_version
        if loaded != version:
            raise RefitError(f"cannot load version {version}: the last transfer received {loaded}")
        self.loading.complete()

    def finish_weight_update(self) -> None:
        """Nothing to finish: every call loads and processes what it received."""

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
