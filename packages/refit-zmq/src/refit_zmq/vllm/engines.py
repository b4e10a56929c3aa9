"""The controller's handle on one vLLM engine of the IPC and sparse rows: its workers' RPCs
and its gate (:class:`~refit_core.vllm.VllmGate`: closed while its model is not one version).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit_core import EngineReport, EngineState, RefitError, WorkerError
from refit_core.backend import refit_error_type
from refit_core.vllm import VllmGate, vllm_client

__all__ = ["VllmEngine", "call_workers", "start_receivers"]

logger = logging.getLogger(__name__)


class VllmEngine:
    """One vLLM engine whose workers each run a refit-zmq receiver.

    Args:
        llm: the engine: an offline ``vllm.LLM``, or an ``AsyncLLM`` as
            :class:`~refit_core.vllm.AsyncVllm`.
        shard: its index among the generation's engines.
        addresses: its workers' receiver addresses, in worker-rank order.
        timeout_s: bound of every RPC that carries no deadline of its own.
    """

    def __init__(self, llm: Any, shard: int, addresses: Sequence[str], timeout_s: float) -> None:
        self.shard = shard
        self.label = f"vllm engine {shard}"
        self.addresses = list(addresses)
        self.gate = VllmGate(llm, self.label)
        self._timeout_s = timeout_s

    def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``method(*args)`` on every worker (through ``refit_zmq_call``); one result per
        worker.

        Raises:
            WorkerError: naming the workers that failed.
        """
        bound = self._timeout_s if timeout_s is None else timeout_s
        return call_workers(self.gate.client, self.label, method, args, bound)

    def settle(self, reason: str) -> EngineReport:
        """After a failed refit: closed if a worker's model was written, else reopened on the
        weights it holds; unknown if the workers cannot be asked (left closed if it was)."""
        try:
            partial = any(self.rpc("partial"))
        except Exception as exc:
            logger.warning("%s: cannot ask its workers after a failure: %s", self.label, exc)
            state = EngineState.CLOSED if self.gate.closed else EngineState.UNKNOWN
            return EngineReport(self.shard, self.label, state, None, reason)
        return self.gate.settle(self.shard, partial=partial, reason=reason)


def start_receivers(
    engines: Sequence[Any], init_info: dict[str, Any], timeout_s: float
) -> list[VllmEngine]:
    """Start the receiver of every worker of every engine (``init_weight_transfer_engine``)
    and collect their addresses."""
    started = []
    for shard, llm in enumerate(engines):
        label = f"vllm engine {shard}"
        call_workers(llm, label, "init_weight_transfer_engine", (init_info,), timeout_s)
        addresses = call_workers(llm, label, "address", (), timeout_s)
        started.append(VllmEngine(llm, shard, addresses, timeout_s))
    return started


def call_workers(
    llm: Any, label: str, method: str, args: tuple[Any, ...], timeout_s: float | None
) -> list[Any]:
    """``method(*args)`` on every worker of ``llm`` (a ``vllm.LLM`` or a
    :class:`~refit_core.vllm.VllmClient`) through ``refit_zmq_call``; one result per worker.

    Raises:
        RefitError: the specific refit error every failed worker raised (by its type's name:
            :class:`~refit_core.VerificationError`, ...), naming the workers (ranks) and why.
        WorkerError: naming the workers that failed otherwise, and why.
    """
    replies = vllm_client(llm).collective_rpc("refit_zmq_call", timeout_s, (method, *args))
    failed = {rank: value for rank, (ok, value) in enumerate(replies) if not ok}
    if failed:
        reasons = "; ".join(f"rank {rank}: {reason}" for rank, reason in failed.items())
        names = {str(reason).partition(":")[0] for reason in failed.values()}
        raised = refit_error_type(names.pop()) if len(names) == 1 else None
        if raised not in (None, RefitError, WorkerError):
            raise raised(f"{label}: {method}: {reasons}")
        raise WorkerError(reasons, worker=label, operation=method)
    return [value for _, value in replies]
