"""A relay beside one engine worker, writing straight into the engine's live weights."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from refit_core.backend import notify
from refit_zmq.relay import CurveConfig, RelayTuning, TensorReceiver, ZmqSparseRefitServer

__all__ = ["EngineRelay", "RelayEngine"]

logger = logging.getLogger(__name__)


class RelayEngine(Protocol):
    """What a relay needs from an engine worker (the reference engine has it; vLLM's worker
    extension provides it in the vLLM issue).

    The engine may also have the optional notifications of
    :class:`refit_core.RefitHooks`: ``on_refit_begin`` before the first byte of a transfer is
    written, ``on_refit_commit`` after a commit, ``on_refit_abort(weights_changed=False)``
    after a rollback restored every bit (this row never leaves partial weights behind while
    its relay lives)."""

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

    Before a transfer's first write the engine is told (``on_refit_begin``, if it has it); on
    commit the engine's version is set, its prefix cache reset and it is told
    (``on_refit_commit``); on rollback the old bits are restored, the cache is reset too
    (generation may have run meanwhile) and it is told (``on_refit_abort``).

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
            on_begin=self._begin,
            on_commit=self._committed,
            on_rollback=self._rolled_back,
        )
        self._server = ZmqSparseRefitServer(
            receiver,
            bind_address=bind_address,
            api_key_env_var=api_key_env_var,
            timeout_s=timeout_s,
            tuning=tuning,
            curve=curve,
        )

    def _begin(self, version: int) -> None:
        notify(self._engine, "on_refit_begin", version)

    def _committed(self, version: int) -> None:
        self._engine.set_weight_version(version)
        self._engine.reset_prefix_cache()
        notify(self._engine, "on_refit_commit", version)

    def _rolled_back(self, version: int) -> None:
        self._engine.reset_prefix_cache()
        notify(self._engine, "on_refit_abort", version, weights_changed=False)

    def start(self) -> str:
        """Start the relay; its address."""
        return self._server.start()

    def close(self) -> None:
        """Stop the relay."""
        self._server.close()
