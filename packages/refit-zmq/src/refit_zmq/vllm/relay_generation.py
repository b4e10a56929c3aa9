"""The controller's side of sparse refits into vLLM engines.

:class:`VllmRelayGeneration` starts a relay in each engine's worker, lists their addresses
for the synchronizer (``ZmqRelayGeneration``), and once the relays committed a version makes
each engine serve it: vLLM's update session pushes the changed layers, then the scheduler's
prefix cache is reset and the version reported to vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit_core import RefitError

__all__ = ["VllmRelayGeneration"]

logger = logging.getLogger(__name__)


class VllmRelayGeneration:
    """Single-worker vLLM engines with refit-zmq's relay receiver, in shard order.

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
        self._engines = list(engines)
        self._timeout_s = control_timeout_s
        init = {
            "bind_address": bind_address,
            "api_key_env_var": api_key_env_var,
            "timeout_s": relay_timeout_s,
        }
        self._addresses: list[str] = []
        for llm in self._engines:
            self._rpc(llm, "init_weight_transfer_engine", init)
            (address,) = self._rpc(llm, "refit_zmq_address")
            self._addresses.append(address)
        logger.info("relays at %s", self._addresses)

    def relay_addresses(self) -> list[str]:
        """The relays' addresses, one per engine, in shard order."""
        return list(self._addresses)

    def refit_committed(self, version: int) -> None:
        """Make every engine serve ``version``, which its relay committed.

        Raises:
            RefitError: naming the engines that could not (the others serve ``version``); a
                later refit pushes everything they missed.
        """
        failures: dict[str, str] = {}
        for address, llm in zip(self._addresses, self._engines, strict=True):
            try:
                self._rpc(llm, "start_weight_update")
                self._rpc(llm, "update_weights", {"version": version})
                self._rpc(llm, "finish_weight_update")
                llm.reset_prefix_cache()
                llm.llm_engine.set_weight_version(str(version))
            except Exception as exc:
                logger.warning("engine %s did not take version %d", address, version, exc_info=True)
                failures[address] = f"{type(exc).__name__}: {exc}"
        if failures:
            raise RefitError(
                f"relays committed version {version} but engines did not load it: {failures}",
                is_retryable=True,
            )

    def _rpc(self, llm: Any, method: str, *args: Any) -> list[Any]:
        replies: list[Any] = llm.collective_rpc(method, timeout=self._timeout_s, args=args)
        return replies
