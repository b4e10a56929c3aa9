"""A relay beside one engine worker, writing straight into the engine's live weights."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from refit_zmq.relay import CurveConfig, RelayTuning, TensorReceiver, ZmqSparseRefitServer

__all__ = ["EngineRelay", "RelayEngine"]

logger = logging.getLogger(__name__)


class RelayEngine(Protocol):
    """What a relay needs from an engine worker (the reference engine has it; vLLM's worker
    extension provides it in the vLLM issue)."""

    @property
    def weight_version(self) -> int:
        """The version of the loaded weights."""
        ...

    def checkpoint_tensors(self) -> Mapping[str, torch.Tensor]:
        """The live weights under checkpoint names (views the relay writes in place)."""
        ...

    def set_weight_version(self, version: int) -> None:
        """Commit a new weight version."""
        ...

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix computed with older weights."""
        ...


class EngineRelay:
    """A relay whose receiver applies payloads to ``engine``'s weights, transactionally.

    On commit the engine's version is set and its prefix cache reset; on rollback the old
    bits are restored and the cache is reset too (generation may have run meanwhile).

    Args:
        engine: the worker's engine.
        bind_address: where the relay listens (default loopback, an ephemeral port).
        api_key_env_var: the environment variable holding the API key (None: no key).
        timeout_s: how long children, senders and queued BEGINs may stay silent.
        tuning: fan-out, chunk size, staging budget.
        curve: the relays' CURVE key pair, when they encrypt.
    """

    def __init__(
        self,
        engine: RelayEngine,
        *,
        bind_address: str = "tcp://127.0.0.1:*",
        api_key_env_var: str | None = None,
        timeout_s: float = 30.0,
        tuning: RelayTuning | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        self._engine = engine
        receiver = TensorReceiver(
            engine.checkpoint_tensors(),
            version=engine.weight_version,
            on_commit=self._committed,
            on_rollback=engine.reset_prefix_cache,
        )
        self._server = ZmqSparseRefitServer(
            receiver,
            bind_address=bind_address,
            api_key_env_var=api_key_env_var,
            timeout_s=timeout_s,
            tuning=tuning,
            curve=curve,
        )

    def _committed(self, version: int) -> None:
        self._engine.set_weight_version(version)
        self._engine.reset_prefix_cache()

    def start(self) -> str:
        """Start the relay; its address."""
        return self._server.start()

    def close(self) -> None:
        """Stop the relay."""
        self._server.close()
