"""The controller's side of sparse refits into vLLM engines.

:class:`VllmRelayGeneration` starts a relay in every worker of each engine (every
tensor-parallel rank), lists their addresses for the synchronizer (``ZmqRelayGeneration``), and
once the relays committed a version makes each engine serve it: the engine is closed (requests
held), vLLM's update session writes the staged deltas and reloads what changed, and the engine
reopens on the new version with its prefix cache dropped. An engine that could not take the
version is reopened on its previous weights (its writes were undone; the next refit resyncs
it) or, if its model was written in part, stays closed until a later refit completes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit_core import EngineReport, EngineState, Recovery, RefitError
from refit_core.backend import with_engines
from refit_zmq.vllm.calls import FinishUpdate, StartUpdate, UpdateWeights
from refit_zmq.vllm.engines import VllmEngine, start_receivers

__all__ = ["VllmRelayGeneration"]

logger = logging.getLogger(__name__)


class VllmRelayGeneration:
    """vLLM engines with refit-zmq's relay receiver, in shard order (relay ``i`` of the
    synchronizer is worker ``i`` of the flattened list: engine 0's ranks first).

    Args:
        engines: ``vllm.LLM`` objects started with :func:`refit_zmq.vllm.engine_args`.
        bind_address: where each relay listens (default loopback, an ephemeral port).
        api_key_env_var: the environment variable holding the relays' API key.
        relay_timeout_s: how long a relay lets children and senders stay silent.
        control_timeout_s: bound of every RPC into an engine.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        bind_address: str = "tcp://127.0.0.1:*",
        api_key_env_var: str | None = None,
        relay_timeout_s: float = 30.0,
        control_timeout_s: float = 120.0,
    ) -> None:
        init = {
            "bind_address": bind_address,
            "api_key_env_var": api_key_env_var,
            "timeout_s": relay_timeout_s,
        }
        self._engines = start_receivers(engines, init, control_timeout_s)
        logger.info("relays at %s", self.relay_addresses())

    def relay_addresses(self) -> list[str]:
        """The relays' addresses, every worker of every engine, in shard order."""
        return [address for engine in self._engines for address in engine.addresses]

    def refit_committed(self, version: int) -> None:
        """Make every engine serve ``version``, which its relays committed.

        Raises:
            RefitError: naming the engines that could not; ``engines`` says what every engine
                serves now (the others: ``version``, state ``new``); the first engine's error
                chained.
        """
        reports: list[EngineReport] = []
        failed: Exception | None = None
        for engine in self._engines:
            try:
                self._serve(engine, version)
            except Exception as exc:
                logger.warning("%s did not take version %d: %s", engine.label, version, exc)
                failed = failed or exc
                reports.append(engine.settle(f"{type(exc).__name__}: {exc}"))
            else:
                reports.append(EngineReport(engine.shard, engine.label, EngineState.NEW, version))
        if failed:
            states = {r.state for r in reports}
            recovery = Recovery.RESYNC if EngineState.OLD in states else Recovery.RETRY
            error = RefitError(
                f"relays committed version {version} but not every engine loaded it",
                recovery=recovery,
            )
            raise with_engines(
                error, [r for r in reports if r.state is not EngineState.NEW]
            ) from failed

    @staticmethod
    def _serve(engine: VllmEngine, version: int) -> None:
        engine.gate.close()
        engine.rpc(StartUpdate())
        engine.rpc(UpdateWeights({"version": version}))
        engine.rpc(FinishUpdate())
        engine.gate.open(version)
