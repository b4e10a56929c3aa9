"""The controller's handle on one vLLM engine of the IPC and sparse rows: its workers' RPCs
and its gate (:class:`~refit_core.vllm.VllmGate`: closed while its model is not one version).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit_core.errors import EngineReport, EngineState
from refit_core.vllm import VllmGate

__all__ = ["VllmEngine", "start_receivers"]

logger = logging.getLogger(__name__)


class VllmEngine:
    """One offline ``vllm.LLM`` engine whose workers each run a refit-zmq receiver.

    Args:
        llm: the engine.
        shard: its index among the generation's engines.
        addresses: its workers' receiver addresses, in worker-rank order.
        timeout_s: bound of every RPC that carries no deadline of its own.
    """

    def __init__(self, llm: Any, shard: int, addresses: Sequence[str], timeout_s: float) -> None:
        self.llm = llm
        self.shard = shard
        self.label = f"vllm engine {shard}"
        self.addresses = list(addresses)
        self.gate = VllmGate(llm, self.label)
        self._timeout_s = timeout_s

    def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``method(*args)`` on every worker; one result per worker."""
        bound = self._timeout_s if timeout_s is None else timeout_s
        replies: list[Any] = self.llm.collective_rpc(method, timeout=bound, args=args)
        return replies

    def settle(self, reason: str) -> EngineReport:
        """After a failed refit: closed if a worker's model was written, else reopened on the
        weights it holds; unknown if the workers cannot be asked (left closed if it was)."""
        try:
            partial = any(self.rpc("refit_zmq_partial"))
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
        llm.collective_rpc("init_weight_transfer_engine", timeout=timeout_s, args=(init_info,))
        addresses = llm.collective_rpc("refit_zmq_address", timeout=timeout_s)
        started.append(VllmEngine(llm, shard, addresses, timeout_s))
    return started
