"""The controller's handles on vLLM engines taking part in a collective refit.

vLLM runs an RPC on every worker of an engine at once, while the synchronizer gives every
worker (tensor-parallel rank) a group rank and a call of its own. :class:`_EngineCalls` joins
them: each worker's call waits until every worker of the engine was called with the same
method, then one ``LLM.collective_rpc`` carries each rank its own call (on a thread of its
own, one RPC at a time per engine, so the controller never blocks).

It also keeps the failure rule: an engine serves one version or nothing. Around the calls that
write the model it closes the engine (:class:`~refit_core.vllm.VllmGate`: requests held, not
aborted); a successful commit reopens it on the new version, a failure that left the model
untouched reopens it on the old one, and a failure after the model was written leaves it
closed until a later complete refit, which the error says (``engines``, state ``closed``).
:class:`VllmCollectiveGeneration` lists the engines' workers as the shards
``build_collective_synchronizer`` expects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from refit_core import EngineReport, EngineState, RefitError, WorkerError
from refit_core.backend import Participant, in_thread, method_name, with_engines
from refit_core.vllm import VllmGate
from refit_nccl.roles import CollectiveEngineRole, JoinRequest
from refit_nccl.vllm.calls import decode_reply, encode_call, reply_partial

__all__ = ["VllmCollectiveGeneration", "VllmWorkerParticipant"]

logger = logging.getLogger(__name__)

_COMMIT = method_name(CollectiveEngineRole.refit_commit)
_TRANSFER = method_name(CollectiveEngineRole.refit_transfer)
_JOIN = method_name(CollectiveEngineRole.refit_join)
_WRITES = frozenset({_TRANSFER, _COMMIT})


class _EngineCalls:
    """One engine's workers, called together (see the module docstring).

    Args:
        llm: the engine.
        shard: its shard index.
        workers: how many workers it runs (tensor x pipeline parallel size).
        staged: whether its receivers stage transfers in host memory (the model is written
            at the commit only) or stream them into the model.
        control_timeout_s: bound of calls that carry no deadline of their own.
        grace_s: added to a call's own deadline before vLLM gives up waiting for the workers.
    """

    def __init__(
        self,
        llm: Any,
        shard: int,
        workers: int,
        *,
        staged: bool,
        control_timeout_s: float,
        grace_s: float,
    ) -> None:
        self.label = f"vllm engine {shard}"
        self.shard = shard
        self.workers = workers
        self.gate = VllmGate(llm, self.label)
        self._llm = llm
        self._staged = staged
        self._control_timeout_s = control_timeout_s
        self._grace_s = grace_s
        self._pending: dict[int, tuple[str, tuple[Any, ...], Future[Any]]] = {}
        self._pending_lock = threading.Lock()
        self._rpc_lock = threading.Lock()

    def submit(self, rank: int, method: str, args: tuple[Any, ...]) -> Future[Any]:
        """Queue ``rank``'s call; the last worker's call starts the RPC. Never blocks."""
        future: Future[Any] = Future()
        with self._pending_lock:
            if rank in self._pending or any(m != method for m, _, _ in self._pending.values()):
                self._fail_pending(method)
            self._pending[rank] = (method, args, future)
            if len(self._pending) < self.workers:
                return future
            batch, self._pending = self._pending, {}
        in_thread(self._run, method, batch, name=f"refit-{self.label}-{method}")
        return future

    def _fail_pending(self, method: str) -> None:
        """Fail a batch that ``method`` interrupts (the synchronizer calls every worker)."""
        for rank, (waiting, _, future) in self._pending.items():
            future.set_exception(
                RefitError(
                    f"{self.label} rank {rank}: {waiting} was not called on every worker "
                    f"before {method}"
                )
            )
        self._pending = {}

    def _run(
        self, method: str, batch: Mapping[int, tuple[str, tuple[Any, ...], Future[Any]]]
    ) -> None:
        args = batch[0][1]
        requests = [encode_call(method, batch[rank][1]) for rank in range(self.workers)]
        try:
            with self._rpc_lock:
                if method == _COMMIT or (method == _TRANSFER and not self._staged):
                    self.gate.close()
                replies: list[bytes] = self._llm.collective_rpc(
                    "refit_nccl_call", timeout=self._timeout_s(method, args), args=(requests,)
                )
                outcomes = self._outcomes(method, args, replies)
        except Exception as exc:
            state = EngineState.CLOSED if self.gate.closed else EngineState.UNKNOWN
            report = EngineReport(self.shard, self.label, state, None, str(exc))
            error = with_engines(
                WorkerError(f"{type(exc).__name__}: {exc}", worker=self.label, operation=method),
                [report],
            )
            for _, _, future in batch.values():
                future.set_exception(error)
            return
        for rank, (_, _, future) in batch.items():
            outcome = outcomes[rank]
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def _outcomes(self, method: str, args: tuple[Any, ...], replies: list[bytes]) -> list[Any]:
        """Each rank's result or error; opens the engine where the call allows it."""
        if len(replies) != self.workers:
            raise RefitError(f"{self.label}: {len(replies)} workers answered, not {self.workers}")
        outcomes: list[Any] = []
        for rank, reply in enumerate(replies):
            try:
                outcomes.append(decode_reply(reply, f"{self.label} rank {rank}", method))
            except RefitError as exc:
                outcomes.append(exc)
        if method not in _WRITES:
            return outcomes
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if not failed:
            if method == _COMMIT:
                self.gate.open(int(outcomes[0]))
            return outcomes
        partial = any(reply_partial(r, self.label) for r in replies)
        report = self.gate.settle(self.shard, partial=partial, reason=str(failed[0]))
        logger.warning("%s: %s failed; engine %s", self.label, method, report.state.value)
        return [with_engines(o, [report]) if isinstance(o, RefitError) else o for o in outcomes]

    def _timeout_s(self, method: str, args: tuple[Any, ...]) -> float | None:
        """The RPC's bound: the call's own deadline plus grace, else the control timeout."""
        if method == _TRANSFER:
            left: float | None = args[1]
        elif method == _JOIN and isinstance(args[0], JoinRequest):
            left = args[0].timeout_s
        else:
            return self._control_timeout_s
        return None if left is None else left + self._grace_s


class VllmWorkerParticipant(Participant[CollectiveEngineRole]):
    """One worker (tensor-parallel rank) of a vLLM engine as a collective participant."""

    def __init__(self, engine: _EngineCalls, rank: int) -> None:
        super().__init__(f"{engine.label} rank {rank}")
        self._engine = engine
        self._rank = rank

    @property
    def key(self) -> Hashable:
        """The engine object and the rank: a restarted engine is another object."""
        return (id(self._engine), self._rank)

    def _start(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        """Run the endpoint call on this worker (with its engine's other workers); never
        blocks.

        Raises:
            TypeError: keyword arguments (calls cross vLLM's RPC positionally).
        """
        if kwargs:
            raise TypeError(f"{name}: calls over vLLM's RPC take positional arguments only")
        return self._engine.submit(self._rank, name, args)

    def close(self) -> None:
        """Nothing to release: the engine belongs to whoever started it."""


class VllmCollectiveGeneration:
    """vLLM engines as a :class:`~refit_nccl.builder.CollectiveGeneration`: shard ``i`` is
    ``engines[i]``, one participant per worker (tensor-parallel rank), each receiving every
    checkpoint tensor whole (vLLM's loader keeps the rank's slice).

    Args:
        engines: ``vllm.LLM`` objects started with :func:`refit_nccl.vllm.engine_args`, in
            shard order.
        staged: stage each transfer in host memory and write the model only at the commit
            (a failed transfer leaves every engine on its old version; memory: one host copy
            of the checkpoint per worker), or stream it into the model (no extra memory; an
            engine whose transfer fails after its first bucket stays closed until a complete
            refit).
        buffer_size_bytes: bucket size every worker declares (None: refit-nccl's default).
        control_timeout_s: bound of calls that carry no deadline of their own.
        grace_s: added to a call's own deadline before vLLM gives up waiting for the workers.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        staged: bool = True,
        buffer_size_bytes: int | None = None,
        control_timeout_s: float = 120.0,
        grace_s: float = 30.0,
    ) -> None:
        self._shards: dict[int, list[Participant[CollectiveEngineRole]]] = {}
        init: dict[str, Any] = {"staged": staged}
        if buffer_size_bytes is not None:
            init["buffer_size_bytes"] = buffer_size_bytes
        for shard, llm in enumerate(engines):
            workers = len(
                llm.collective_rpc(
                    "init_weight_transfer_engine", timeout=control_timeout_s, args=(init,)
                )
            )
            engine = _EngineCalls(
                llm,
                shard,
                workers,
                staged=staged,
                control_timeout_s=control_timeout_s,
                grace_s=grace_s,
            )
            self._shards[shard] = [VllmWorkerParticipant(engine, r) for r in range(workers)]

    def collective_shards(self) -> Mapping[int, Sequence[Participant[CollectiveEngineRole]]]:
        """Shard index -> its workers' participants (the same objects on every call)."""
        return self._shards
