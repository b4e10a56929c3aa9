"""The controller's side of colocated IPC refits into vLLM engines.

:class:`VllmIpcGeneration` binds an IPC receiver in each engine's worker, lists their control
addresses for the synchronizer (``IpcGeneration``), and runs each refit inside vLLM's update
session (``RefitSessions``): before ``begin`` every worker enters ``update_weights`` (serving
the control socket), after the commit or abort the session is finished, and after a commit
the scheduler's prefix cache is reset and the version reported to vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from refit_core import RefitError

__all__ = ["VllmIpcGeneration"]

logger = logging.getLogger(__name__)


class VllmIpcGeneration:
    """Single-worker vLLM engines with refit-zmq's IPC receiver, in shard order.

    Args:
        engines: ``vllm.LLM`` objects started with ``refit_zmq.vllm.engine_args("ipc")``.
        bind_address: where each control socket binds (default loopback, an ephemeral port).
        control_timeout_s: bound of every RPC that carries no deadline of its own.
        grace_s: added to a refit's deadline before vLLM gives up waiting for the worker.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        bind_address: str = "tcp://127.0.0.1:*",
        control_timeout_s: float = 120.0,
        grace_s: float = 30.0,
    ) -> None:
        self._engines = list(engines)
        self._timeout_s = control_timeout_s
        self._grace_s = grace_s
        self._executor = ThreadPoolExecutor(len(self._engines), thread_name_prefix="refit-ipc")
        self._sessions: list[Future[None]] = []
        self._addresses: list[str] = []
        for llm in self._engines:
            self._rpc(llm, "init_weight_transfer_engine", {"bind_address": bind_address})
            (address,) = self._rpc(llm, "refit_zmq_address")
            self._addresses.append(address)
        logger.info("ipc receivers at %s", self._addresses)

    def ipc_addresses(self) -> list[str]:
        """The receivers' control addresses, one per engine, in shard order."""
        return list(self._addresses)

    def refit_started(self, version: int, timeout_s: float | None) -> None:
        """Put every worker into an update session serving the refit; returns at once."""
        self._sessions = [
            self._executor.submit(self._serve, llm, timeout_s) for llm in self._engines
        ]

    def _serve(self, llm: Any, timeout_s: float | None) -> None:
        self._rpc(llm, "start_weight_update")
        bound = None if timeout_s is None else timeout_s + self._grace_s
        llm.collective_rpc("update_weights", timeout=bound, args=({"timeout_s": timeout_s},))

    def refit_finished(self, version: int, committed: bool) -> None:
        """Finish every session; after a commit the engines serve ``version``.

        Raises:
            RefitError: naming the engines whose session failed.
        """
        failures: dict[str, str] = {}
        sessions, self._sessions = self._sessions, []
        for address, llm, session in zip(self._addresses, self._engines, sessions, strict=True):
            try:
                session.result(timeout=self._timeout_s)
                self._rpc(llm, "finish_weight_update")
                if committed:
                    llm.reset_prefix_cache()
                    llm.llm_engine.set_weight_version(str(version))
            except Exception as exc:
                logger.warning("engine %s: refit %d session failed", address, version)
                failures[address] = f"{type(exc).__name__}: {exc}"
        if failures:
            raise RefitError(f"refit {version}: engine sessions failed: {failures}")

    def close(self) -> None:
        """Stop the session threads (the engines belong to whoever started them)."""
        self._executor.shutdown(wait=False)

    def _rpc(self, llm: Any, method: str, *args: Any) -> list[Any]:
        replies: list[Any] = llm.collective_rpc(method, timeout=self._timeout_s, args=args)
        return replies
