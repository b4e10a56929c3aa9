"""The controller's side of colocated IPC refits into vLLM engines.

:class:`VllmIpcGeneration` binds an IPC receiver in every worker of each engine (every
tensor-parallel rank reads the shared buffers), lists their control addresses for the
synchronizer (``IpcGeneration``), and runs each refit inside vLLM's update session
(``RefitSessions``): before ``begin`` every worker enters ``update_weights`` (serving the control
socket); after the commit each engine is closed, loads the refit (``apply``: the staged tensors,
or nothing more when streamed), and reopens on the new version; after a failure each engine is
reopened on its old weights, or left closed where its model was written.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from refit_core import EngineHealth, EngineReport, EngineStatus, FleetStatus, RefitError
from refit_core.backend import with_engines
from refit_zmq.vllm.calls import FinishUpdate, Partial, StartUpdate, UpdateWeights, Versions
from refit_zmq.vllm.engines import VllmEngine, start_receivers

__all__ = ["VllmIpcGeneration"]

logger = logging.getLogger(__name__)


class VllmIpcGeneration:
    """vLLM engines with refit-zmq's IPC receiver, in shard order (shard ``i`` of the
    synchronizer is worker ``i`` of the flattened list: engine 0's ranks first).

    Args:
        engines: ``vllm.LLM`` objects started with ``refit_zmq.vllm.engine_args("ipc")``.
        staged: stage each refit in host memory and load it only once every worker received it
            whole (a failed refit leaves every engine on its old version; memory: one host
            copy of the checkpoint per worker), or stream it into the model (no extra memory;
            an engine whose refit fails after its first bucket stays closed until a complete
            refit).
        bind_address: where each control socket binds (default loopback, an ephemeral port).
        control_timeout_s: bound of every RPC that carries no deadline of its own.
        grace_s: added to a refit's deadline before vLLM gives up waiting for the workers.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        staged: bool = True,
        bind_address: str = "tcp://127.0.0.1:*",
        control_timeout_s: float = 120.0,
        grace_s: float = 30.0,
    ) -> None:
        self._staged = staged
        self._grace_s = grace_s
        self._control_timeout_s = control_timeout_s
        self._engines = start_receivers(
            engines, {"bind_address": bind_address, "staged": staged}, control_timeout_s
        )
        self._executor = ThreadPoolExecutor(len(self._engines), thread_name_prefix="refit-ipc")
        self._sessions: list[Future[None]] = []
        logger.info("ipc receivers at %s", self.ipc_addresses())

    def ipc_addresses(self) -> list[str]:
        """The receivers' control addresses, every worker of every engine, in shard order."""
        return [address for engine in self._engines for address in engine.addresses]

    def refit_started(self, version: int, timeout_s: float | None) -> None:
        """Put every worker into an update session serving the refit (a streamed refit closes
        each engine first); returns at once."""
        self._sessions = [
            self._executor.submit(self._serve, engine, timeout_s) for engine in self._engines
        ]

    def _serve(self, engine: VllmEngine, timeout_s: float | None) -> None:
        if not self._staged:
            engine.gate.close()
        engine.rpc(StartUpdate())
        bound = None if timeout_s is None else timeout_s + self._grace_s
        engine.rpc(UpdateWeights({"timeout_s": timeout_s}), timeout_s=bound)

    def refit_finished(self, version: int, committed: bool) -> None:
        """End every session: after a commit each engine loads the refit and serves
        ``version``; after a failure each serves its old weights, or stays closed where its
        model was written.

        Raises:
            RefitError: after a failure always, with each engine's state (``engines``); after
                a commit, naming the engines that could not load it (the first engine's error
                chained: a :class:`~refit_core.VerificationError` where its load left the
                model other than the refit).
        """
        failures: dict[str, str] = {}
        first: Exception | None = None
        reports: list[EngineReport] = []
        sessions, self._sessions = self._sessions, []
        for engine, session in zip(self._engines, sessions, strict=True):
            try:
                session.result(timeout=self._control_timeout_s)
                if committed:
                    self._load(engine, version)
                    continue
                engine.rpc(FinishUpdate())
                reports.append(engine.settle(f"refit {version} aborted"))
            except Exception as exc:
                logger.warning("%s: refit %d failed here: %s", engine.label, version, exc)
                failures[engine.label] = f"{type(exc).__name__}: {exc}"
                first = first or exc
                reports.append(engine.settle(str(exc)))
        if failures or not committed:
            what = f"engines failed: {failures}" if failures else "aborted"
            raise with_engines(RefitError(f"refit {version}: {what}"), reports) from first

    def _load(self, engine: VllmEngine, version: int) -> None:
        engine.gate.close()
        engine.rpc(UpdateWeights({"apply": True}))
        engine.rpc(FinishUpdate())
        engine.gate.open(version)

    def fleet_status(self) -> FleetStatus:
        """Every worker as the synchronizer's shards list them (engine 0's ranks first): the
        version its receiver committed last, the highest one a refit began on it, closed
        while its model holds a refit that did not commit (a new controller adopts these)."""
        statuses: list[tuple[str, EngineHealth, int | None, int | None, str | None]] = []
        for engine in self._engines:
            try:
                versions = engine.rpc(Versions())
                partial = any(engine.rpc(Partial()))
            except RefitError as exc:
                detail = f"{type(exc).__name__}: {exc}"[:200]
                statuses += [
                    (a, EngineHealth.UNREACHABLE, None, None, detail) for a in engine.addresses
                ]
                continue
            for address, (version, began) in zip(engine.addresses, versions, strict=True):
                if partial:
                    statuses.append((address, EngineHealth.CLOSED, None, began, "partial model"))
                else:
                    statuses.append((address, EngineHealth.SERVING, version, began, None))
        return FleetStatus.of(
            EngineStatus(shard, address, health, version, detail=detail, began_version=began)
            for shard, (address, health, version, began, detail) in enumerate(statuses)
        )

    def close(self) -> None:
        """Stop the session threads (the engines belong to whoever started them)."""
        self._executor.shutdown(wait=False)
