"""The packed-collective receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` under :data:`~refit_nccl.vllm.BACKEND` by the
``vllm.general_plugins`` entry point of refit-nccl, so an engine started with
``weight_transfer_config={"backend": "refit_nccl"}`` builds one in each worker (every tensor
parallel rank). It holds an :class:`~refit_nccl.roles.engine.EngineEndpoint` whose engine is the
worker's model. Each rank joins the refit group as a rank of its own and receives every
checkpoint tensor whole; vLLM's loader keeps the rank's slice.

Buckets reach the model through :class:`~refit_core.vllm.loading.CheckpointLoading`: staged
(default) in host memory (on a host group every bucket is received straight into the one host
copy, laid out by the plan) and loaded at the commit, so a transfer that fails leaves the model
untouched, or streamed into vLLM's layerwise reload as they arrive, so a transfer that fails
after its first bucket leaves the model partial (the controller keeps such an engine closed).
Every call that writes the model runs inside vLLM's own update session
(``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update``).

A staged receiver also stages while the engine serves (:meth:`VllmCollectiveReceiver.stage`):
the transfer runs on a thread of its own, so the worker keeps running forward passes (an RPC
that received the whole refit would hold vLLM's engine core for as long), and writes host
memory only; the controller polls it, and commits it later in one pause.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit_core import RefitError
from refit_core.backend import CollectiveSenderSpec, checkpoint_specs, dtype_name, in_thread
from refit_core.vllm.loading import CheckpointLoading, LoadingReceiver, runtime_check
from refit_nccl.roles.contract import WorkerRefitStatus
from refit_nccl.roles.engine import EngineEndpoint
from refit_nccl.transfer.geometry import DEFAULT_GEOMETRY
from refit_nccl.transfer.stats import TransferStats

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
    """The worker's model as a :class:`~refit_nccl.roles.engine.CollectiveEngine`."""

    def __init__(self, receiver: VllmCollectiveReceiver) -> None:
        self._receiver = receiver
        self.weight_version = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        receiver = self._receiver
        receiver.loading.take(weights, copy=not receiver.endpoint.receives_in_place)
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
        self.staged_version: int | None = None
        """The version received whole into host memory by :meth:`stage`, not yet committed
        or dropped."""
        self._staging: Future[TransferStats] | None = None
        self._stagings = 0
        self._staging_lock = threading.Lock()

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Declare a packing geometry and the staging mode (leaves any current group); the
        first call also builds the runtime check of the model.

        Raises:
            RefitError: refit cannot keep this model exact (the parameter named).
        """
        geometry = CollectiveSenderSpec("refit", init_info.buffer_size_bytes, init_info.num_buffers)
        self.drop_staged()  # a staging still running is aborted on the endpoint it uses
        self.endpoint.refit_abort("geometry changed")
        held = self.endpoint.refit_status()  # the versions outlive the endpoint
        # vLLM's model is written through its layerwise reload (``self.loading``), which the
        # endpoint's own refit_stage does not drive: this receiver stages itself (``stage``).
        self.endpoint = EngineEndpoint(
            lambda: _WorkerModel(self),
            geometry,
            can_stage=False,
            versions=(held.committed_version, held.began_version),
            keeps_received=init_info.staged,
        )
        self.loading.abandon()
        self.loading.staged = init_info.staged
        if self.loading.check is None:
            self.loading.check = runtime_check(self)
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

    def stage(self, version: int, timeout_s: float | None) -> None:
        """Start receiving ``version`` into host memory on a thread of its own; returns at
        once (:meth:`staging_outcome` says when it ended). The model is not touched.

        Raises:
            NotImplementedError: this receiver streams into the model (``staged=False``).
            RefitError: a staging is still running.
        """
        if not self.loading.staged:
            raise NotImplementedError(
                "a streaming refit-nccl receiver (staged=False) cannot stage beside the model"
            )
        with self._staging_lock:
            if self._staging is not None and not self._staging.done():
                raise RefitError("a staging is still running on this worker")
            self.staged_version = None
            self._stagings += 1
            self._staging = in_thread(
                self._receive_staged,
                version,
                timeout_s,
                self._stagings,
                name=f"refit-nccl-stage-{version}",
            )

    def _receive_staged(self, version: int, timeout_s: float | None, staging: int) -> TransferStats:
        self.receive_weights(CollectiveUpdateInfo(version, timeout_s))
        stats = self.transferred()
        with self._staging_lock:
            if self._stagings == staging and self._staging is not None:  # not dropped since
                self.staged_version = version
        logger.info("staged version %d in %.3f s", version, stats.total_s)
        return stats

    def staging_outcome(self) -> TransferStats | None:
        """The running staging's stats once it ended (None while it runs); raises its error.

        Raises:
            RefitError: no staging was started.
        """
        staging = self._staging
        if staging is None:
            raise RefitError("no staging was started on this worker")
        return staging.result() if staging.done() else None

    def take_staged(self, version: int) -> None:
        """Claim the staged ``version`` for its commit (the caller loads it, as
        ``update_weights`` with ``apply``).

        Raises:
            RefitError: ``version`` is not what this worker staged.
        """
        with self._staging_lock:
            if self.staged_version != version:
                raise RefitError(f"cannot commit version {version}: staged {self.staged_version}")
            self.staged_version = None
            self._staging = None

    def drop_staged(self) -> None:
        """Forget what was staged; a staging still running is aborted (its group with it)."""
        with self._staging_lock:
            running = self._staging is not None and not self._staging.done()
            self._staging = None
            self.staged_version = None
        if running:
            self.endpoint.refit_abort("the staged refit was dropped")
        else:
            self.loading.abandon()

    def status(self) -> WorkerRefitStatus:
        """The endpoint's state, closed only if the model holds weights of no served version
        (a staged transfer never writes it), with this receiver's staging (it stages when
        staged)."""
        return replace(
            self.endpoint.refit_status(),
            closed=self.loading.partial,
            staged_version=self.staged_version,
            can_stage=self.loading.staged,
        )

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
