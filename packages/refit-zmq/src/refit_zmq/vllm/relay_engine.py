"""The sparse relay receiver inside a vLLM worker, as a vLLM weight-transfer engine.

Registered with ``WeightTransferEngineFactory`` as ``refit_zmq_sparse`` by refit-zmq's
``vllm.general_plugins`` entry point (:data:`~refit_zmq.vllm.BACKENDS`).
``init_weight_transfer_engine`` starts an :class:`~refit_zmq.sparse.EngineRelay` whose
receiver applies deltas, transactionally, to a :class:`~refit_zmq.vllm.shadow.ShadowWeights`
copy; the model is untouched until the controller, after the relays committed, runs vLLM's
update session (``start_weight_update`` -> ``update_weights({"version": v})`` ->
``finish_weight_update``), which pushes the changed layers through layerwise reload on the
worker's own thread. A rolled-back transfer never reaches the model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from refit_core import RefitError
from refit_zmq.relay import CurveConfig
from refit_zmq.sparse import EngineRelay
from refit_zmq.vllm.shadow import ShadowWeights

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


class _ShadowEngine:
    """The shadow as the :class:`~refit_zmq.sparse.RelayEngine` the relay writes."""

    def __init__(self, shadow: ShadowWeights) -> None:
        self._shadow = shadow

    @property
    def weight_version(self) -> int:
        return self._shadow.version

    def checkpoint_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._shadow.tensors

    def set_weight_version(self, version: int) -> None:
        self._shadow.version = version

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: the model serves the pushed version, not the shadow's."""


class VllmRelayReceiver(WeightTransferEngine):  # type: ignore[misc]
    """refit-zmq's sparse receiver in one vLLM worker."""

    init_info_cls = RelayInitInfo
    update_info_cls = RelayUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shadow: ShadowWeights | None = None
        self.relay: EngineRelay | None = None
        self.address: str | None = None
        self._reloading = False

    def init_transfer_engine(self, init_info: RelayInitInfo) -> None:
        """Copy the checkpoint into the shadow (first time only) and (re)start the relay."""
        if self.shadow is None:
            loader = get_model_loader(self.vllm_config.load_config)
            weights = loader.get_all_weights(self.model_config, self.model)
            self.shadow = ShadowWeights((n, t.to(self.model_config.dtype)) for n, t in weights)
            logger.info("refit-zmq shadow: %d bytes", self.shadow.nbytes)
        self.shutdown()
        self.relay = EngineRelay(
            _ShadowEngine(self.shadow),
            bind_address=init_info.bind_address,
            api_key_env_var=init_info.api_key_env_var,
            timeout_s=init_info.timeout_s,
            curve=CurveConfig.from_env(),
        )
        self.address = self.relay.start()
        logger.info("refit-zmq relay at %s", self.address)

    def start_weight_update(self) -> None:
        """Put the model into layerwise reload."""
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def receive_weights(self, update_info: RelayUpdateInfo) -> None:
        """Push the layers the committed transfer changed (a failure ends the reload at once;
        the next push repeats every layer not pushed since)."""
        if self.shadow is None:
            self.finish_weight_update()
            raise RefitError("the relay was never started (init_weight_transfer_engine)")
        try:
            self.shadow.push(update_info.version, self.model)
        except BaseException:
            self.finish_weight_update()
            raise

    def finish_weight_update(self) -> None:
        """Process the pushed layers into vLLM's kernel layout."""
        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Stop the relay (the shadow stays)."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None
