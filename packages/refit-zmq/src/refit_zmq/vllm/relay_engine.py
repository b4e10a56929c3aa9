"""The sparse relay receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` as ``refit_zmq_sparse`` by refit-zmq's
``vllm.general_plugins`` entry point (:data:`~refit_zmq.vllm.BACKENDS`). Every worker (every
tensor-parallel rank) runs a relay of the tree and receives every payload; it keeps only the
writes its own slices need.

``init_weight_transfer_engine`` decides, once, where each checkpoint tensor lives
(:mod:`~refit_zmq.vllm.targets`: in place in the runtime parameters through the verified write
map, or in the checkpoint-format shadow for repacked modules) and starts the relay, whose
receiver stages deltas (:class:`~refit_zmq.vllm.delta_receiver.StagedDeltas`). Once every relay
committed, the controller closes the engine and runs vLLM's update session
(``start_weight_update`` -> ``update_weights({"version": v})`` -> ``finish_weight_update``),
which writes the staged deltas in place and into the shadow (with undo: a failure restores
every bit and the worker drops back to its previous version) and then reloads the shadowed
modules that changed through vLLM's layerwise reload (a failure there leaves the model partial:
the engine stays closed until a later refit completes the reload).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader import get_model_loader

from refit_core import RefitError
from refit_core.backend import checkpoint_specs, dtype_name
from refit_core.vllm.loading import CheckpointLoading, runtime_check
from refit_core.vllm.write_map import capture_write_map
from refit_zmq.codec import tensor_digest
from refit_zmq.relay import CurveConfig, ZmqSparseRefitServer
from refit_zmq.vllm.delta_receiver import StagedDeltas
from refit_zmq.vllm.targets import CheckpointTargets, plan_targets

__all__ = ["RelayInitInfo", "RelayUpdateInfo", "VllmRelayReceiver"]

logger = logging.getLogger(__name__)


@dataclass
class RelayInitInfo:
    """``init_weight_transfer_engine`` arguments: where the relay listens and its security."""

    bind_address: str = "tcp://127.0.0.1:*"
    api_key_env_var: str | None = None
    timeout_s: float = 30.0


@dataclass
class RelayUpdateInfo:
    """``update_weights`` arguments: serve ``version``, which the relay committed."""

    version: int


class VllmRelayReceiver(WeightTransferEngine):  # type: ignore[misc]
    """refit-zmq's sparse receiver in one vLLM worker."""

    init_info_cls = RelayInitInfo
    update_info_cls = RelayUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.targets: CheckpointTargets | None = None
        self.deltas: StagedDeltas | None = None
        self.relay: ZmqSparseRefitServer | None = None
        self.address: str | None = None
        self.served_version = 0
        self.last_apply_s: float | None = None
        """How long writing the last committed version into the model took."""
        self.loading = CheckpointLoading(self, staged=False)
        self._unloaded: set[str] = set()

    @property
    def partial(self) -> bool:
        """Whether the model holds weights other than the version it serves."""
        return self.loading.partial

    def init_transfer_engine(self, init_info: RelayInitInfo) -> None:
        """Place the checkpoint tensors (first time only) and (re)start the relay."""
        if self.targets is None or self.deltas is None:
            self.targets, specs = self._place()
            self.deltas = StagedDeltas(self.targets, specs, version=self.served_version)
        self.shutdown()
        self.relay = ZmqSparseRefitServer(
            self.deltas,
            bind_address=init_info.bind_address,
            api_key_env_var=init_info.api_key_env_var,
            timeout_s=init_info.timeout_s,
            curve=CurveConfig.from_env(),
        )
        self.address = self.relay.start()
        logger.info("refit-zmq relay at %s", self.address)

    def _place(self) -> tuple[CheckpointTargets, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        config = self.model_config
        served = dtype_name(config.dtype)
        specs = {
            name: (shape, getattr(torch, dtype))
            for name, (shape, dtype) in checkpoint_specs(config.model, served).items()
        }
        loader = get_model_loader(self.vllm_config.load_config)

        def checkpoint() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in loader.get_all_weights(config, self.model):
                yield name, tensor.to(specs[name][1]) if name in specs else tensor

        found = capture_write_map(self.model, specs)
        self.loading.check = runtime_check(self, found)
        plan = plan_targets(self.model, found, specs, checkpoint)
        shadow = {n: t.clone() for n, t in checkpoint() if n in plan.shadowed}
        targets = CheckpointTargets(self.model, plan, shadow)
        logger.info(
            "refit-zmq targets: %d bytes in place, %d bytes in the shadow (%d of %d tensors)",
            targets.in_place_bytes,
            targets.shadow_bytes,
            len(shadow),
            len(specs),
        )
        return targets, specs

    def start_weight_update(self) -> None:
        """Nothing to prepare: the update writes in place, then reloads what changed."""

    def receive_weights(self, update_info: RelayUpdateInfo) -> None:
        """Bring the model to ``version``, which the relay committed (see the module
        docstring for what a failure leaves)."""
        if self.targets is None or self.deltas is None:
            raise RefitError("the relay was never started (init_weight_transfer_engine)")
        started = time.perf_counter()
        committed, writes = self.deltas.take_committed()
        if committed != update_info.version:
            raise RefitError(
                f"cannot serve version {update_info.version}: the relay committed {committed}"
            )
        try:
            undo = self.targets.apply(writes)
        except BaseException:
            self.deltas.restore_version(self.served_version)
            raise
        undo.discard()
        self._unloaded |= {w.name for w in writes if w.name in self.targets.shadow}
        items = self.targets.reload_items(self._unloaded)
        if items:
            self.loading.begin()
            try:
                self.loading.take(items, copy=False)
                self.loading.complete()
            except BaseException:
                self.loading.abandon()
                raise
        self._unloaded = set()
        self.loading.committed()
        self.served_version = committed
        self.last_apply_s = time.perf_counter() - started
        logger.info(
            "version %d served: %d writes, %d tensors reloaded", committed, len(writes), len(items)
        )

    def finish_weight_update(self) -> None:
        """Nothing to finish: every update completes its reload."""

    def placement(self) -> dict[str, Any]:
        """Where the checkpoint tensors live: ``in_place_bytes`` and ``shadow_bytes`` of this
        worker, the ``shadowed`` names, and why each reloaded module is (``reasons``).

        Raises:
            RefitError: the relay was never started (init_weight_transfer_engine).
        """
        if self.targets is None:
            raise RefitError("the relay was never started (init_weight_transfer_engine)")
        return {
            "in_place_bytes": self.targets.in_place_bytes,
            "shadow_bytes": self.targets.shadow_bytes,
            "shadowed": sorted(self.targets.plan.shadowed),
            "reasons": dict(self.targets.plan.reasons),
        }

    def checkpoint_digests(self) -> dict[str, int]:
        """Bitwise digest of every checkpoint tensor as the model holds it, read back from the
        runtime parameters or the shadow.

        Raises:
            RefitError: the relay was never started, or this worker holds only a slice of a
                tensor (tensor parallelism).
        """
        if self.targets is None:
            raise RefitError("the relay was never started (init_weight_transfer_engine)")
        names = sorted(set(self.targets.plan.pieces) | set(self.targets.shadow))
        return {n: tensor_digest(self.targets.checkpoint_tensor(n)) for n in names}

    def shutdown(self) -> None:
        """Stop the relay (the targets stay)."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None
