"""The controller's handle on one vLLM engine of the IPC and sparse rows: its workers' RPCs
and its gate (:class:`~refit_core.vllm.VllmGate`: closed while its model is not one version).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from refit_core import EngineReport, EngineState, RefitError, WorkerError
from refit_core.backend import encode, refit_error_type, reply_from_bytes
from refit_core.vllm import VllmGate, vllm_client
from refit_zmq.vllm.calls import Address, InitReceiver, Partial, ZmqCall

__all__ = ["VllmEngine", "call_workers", "start_receivers"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


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

    def rpc(self, call: ZmqCall[_R], *, timeout_s: float | None = None) -> list[_R]:
        """``call`` on every worker (through ``refit_zmq_call``); one result per worker.

        Raises:
            WorkerError: naming the workers that failed.
        """
        bound = self._timeout_s if timeout_s is None else timeout_s
        return call_workers(self.gate.client, self.label, call, bound)

    def settle(self, reason: str) -> EngineReport:
        """After a failed refit: closed if a worker's model was written, else reopened on the
        weights it holds; unknown if the workers cannot be asked (left closed if it was)."""
        try:
            partial = any(self.rpc(Partial()))
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
        call_workers(llm, label, InitReceiver(init_info), timeout_s)
        addresses = call_workers(llm, label, Address(), timeout_s)
        started.append(VllmEngine(llm, shard, addresses, timeout_s))
    return started


def call_workers(llm: Any, label: str, call: ZmqCall[_R], timeout_s: float | None) -> list[_R]:
    """``call`` on every worker of ``llm`` (a ``vllm.LLM`` or a
    :class:`~refit_core.vllm.VllmClient`) through ``refit_zmq_call``; one result per worker.

    Raises:
        RefitError: the specific refit error every failed worker raised (by its type's name:
            :class:`~refit_core.VerificationError`, ...), naming the workers (ranks) and why.
        WorkerError: naming the workers that failed otherwise, and why.
        ProtocolError: a worker answered with something other than a reply.
    """
    data, operation = encode(call), type(call).__name__
    answers = vllm_client(llm).collective_rpc("refit_zmq_call", timeout_s, (data,))
    replies = [reply_from_bytes(a, f"{label} rank {rank}") for rank, a in enumerate(answers)]
    failed = {rank: reply for rank, reply in enumerate(replies) if not reply.ok}
    if failed:
        reasons = "; ".join(
            f"rank {rank}: {r.error_type}: {r.error_message}" for rank, r in failed.items()
        )
        names = {r.error_type or "" for r in failed.values()}
        raised = refit_error_type(names.pop()) if len(names) == 1 else None
        if raised not in (None, RefitError, WorkerError):
            raise raised(f"{label}: {operation}: {reasons}")
        raise WorkerError(reasons, worker=label, operation=operation)
    return [reply.result for reply in replies]  # type: ignore[misc]  # every reply is ok
