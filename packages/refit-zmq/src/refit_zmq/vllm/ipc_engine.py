"""The colocated IPC receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` as ``refit_zmq_ipc`` by refit-zmq's
``vllm.general_plugins`` entry point (:data:`~refit_zmq.vllm.BACKENDS`).
``init_weight_transfer_engine`` binds an :class:`~refit_zmq.ipc.IpcReceiver` over the worker's
model (every tensor-parallel rank has its own and reads every checkpoint tensor whole from the
shared buffers; vLLM's loader keeps the rank's slice). Each refit is one vLLM update session:
``update_weights({"timeout_s"})`` serves the trainer's control socket until the refit commits
or aborts, ``update_weights({"apply": True})`` (sent by the controller once every worker
committed) makes the refit the one the model serves, and ``finish_weight_update`` ends it.

Buckets reach the model through :class:`~refit_core.vllm.loading.CheckpointLoading`: staged
(default) in host memory and loaded by ``apply``, so a refit that fails anywhere leaves the
model untouched, or streamed into vLLM's layerwise reload as they arrive, so a refit that fails
after its first bucket leaves the model partial until a complete refit (the controller keeps
such an engine closed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit_core import RefitError
from refit_core.backend import checkpoint_specs, dtype_name
from refit_core.vllm.loading import CheckpointLoading, LoadingReceiver, runtime_check
from refit_zmq.ipc import IpcReceiver

__all__ = ["IpcInitInfo", "IpcUpdateInfo", "VllmIpcReceiver"]

logger = logging.getLogger(__name__)


@dataclass
class IpcInitInfo:
    """``init_weight_transfer_engine`` arguments: where the control socket binds and whether
    refits are staged in host memory until they complete."""

    bind_address: str = "tcp://127.0.0.1:*"
    staged: bool = True


@dataclass
class IpcUpdateInfo:
    """``update_weights`` arguments: serve one refit within ``timeout_s`` (None: no limit), or,
    with ``apply``, make the refit this session committed the one the model serves."""

    timeout_s: float | None = None
    apply: bool = False


class _WorkerModel:
    """The worker's model as the :class:`~refit_zmq.ipc.IpcEngine` the receiver loads."""

    def __init__(self, receiver: VllmIpcReceiver) -> None:
        self._receiver = receiver

    @property
    def stages_refits(self) -> bool:
        """Whether a refit reaches the model only after its commit."""
        return self._receiver.loading.staged

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        self._receiver.loading.take(weights)
        return None

    def set_weight_version(self, version: int) -> None:
        self._receiver.received = version
        logger.info("ipc: version %d received", version)

    def reset_prefix_cache(self) -> None:
        """Nothing to drop here: the prefix cache lives in vLLM's scheduler, which the
        controller resets when it reopens the engine (:class:`~refit_core.vllm.VllmGate`)."""

    def checkpoint_tensor_specs(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        config = self._receiver.model_config
        return checkpoint_specs(config.model, dtype_name(config.dtype))


class VllmIpcReceiver(LoadingReceiver, WeightTransferEngine):  # type: ignore[misc]
    """refit-zmq's colocated IPC receiver in one vLLM worker."""

    init_info_cls = IpcInitInfo
    update_info_cls = IpcUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: IpcReceiver | None = None
        self.address: str | None = None
        self.loading = CheckpointLoading(self, staged=True)
        self.received: int | None = None
        """The version this session's refit committed (None: none yet)."""

    def init_transfer_engine(self, init_info: IpcInitInfo) -> None:
        """(Re)bind the control socket and set the staging mode; the versions carry over. The
        first call also builds the runtime check of the model.

        Raises:
            RefitError: refit cannot keep this model exact (the parameter named).
        """
        version, began = (0, 0) if self.receiver is None else self.versions
        self.shutdown()
        self.loading.abandon()
        self.loading.staged = init_info.staged
        if self.loading.check is None:
            self.loading.check = runtime_check(self)
        self.receiver = IpcReceiver(
            _WorkerModel(self), bind_address=init_info.bind_address, version=version, began=began
        )
        self.address = self.receiver.address
        logger.info("ipc receiver at %s (version %d)", self.address, version)

    @property
    def versions(self) -> tuple[int, int]:
        """The version the receiver committed last and the highest one a refit began.

        Raises:
            RefitError: the receiver was never bound.
        """
        if self.receiver is None:
            raise RefitError("the IPC receiver was never bound (init_weight_transfer_engine)")
        return self.receiver.version, self.receiver.began

    def start_weight_update(self) -> None:
        """Start a session: nothing received yet (loading opens vLLM's layerwise reload when the
        model is first written)."""
        self.received = None
        self.loading.begin()

    def receive_weights(self, update_info: IpcUpdateInfo) -> None:
        """Serve one refit, or apply the one this session committed; a failed refit drops what
        was staged, or, streamed, ends the reload at once with the model partial."""
        if update_info.apply:
            if self.received is None:
                raise RefitError("no refit committed in this update session: nothing to apply")
            self.loading.complete()
            self.loading.committed()
            return
        try:
            if self.receiver is None:
                raise RefitError("the IPC receiver was never bound (init_weight_transfer_engine)")
            self.receiver.serve_refit(update_info.timeout_s)
            if not self.loading.staged:
                self.loading.complete()
        except BaseException:
            self.loading.abandon()
            raise

    def finish_weight_update(self) -> None:
        """End the session; a refit not applied is dropped (staged) or leaves the model
        partial (streamed)."""
        self.loading.abandon()
        self.received = None

    def shutdown(self) -> None:
        """Close the control socket."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
