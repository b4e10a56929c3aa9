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

A staging (``refit_stage``, and the transfer of a staged ``sync_weights``) never closes the
engine: its workers receive on threads of their own while the engine generates, and the call
polls them every :data:`STAGING_POLL_S` (each poll a short RPC between two engine steps)
until every worker ended or the call's deadline passed; other calls (an abort) go in between
polls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from refit_core import EngineReport, EngineState, RefitError, RefitTimeoutError, WorkerError
from refit_core.backend import (
    Participant,
    WorkerReply,
    checked_buffer_size,
    encode,
    in_thread,
    reply_from_bytes,
    with_engines,
)
from refit_core.vllm import VllmClient, VllmGate, vllm_client
from refit_nccl.roles.contract import CollectiveEngineRole
from refit_nccl.vllm.calls import EngineCall, Staging, engine_call

__all__ = ["STAGING_POLL_S", "VllmCollectiveGeneration", "VllmWorkerParticipant"]

logger = logging.getLogger(__name__)

STAGING_POLL_S = 0.02
"""How often a staging's workers are asked whether they ended."""


class _EngineCalls:
    """One engine's workers, called together (see the module docstring).

    Args:
        client: the engine.
        shard: its shard index.
        workers: how many workers it runs (tensor x pipeline parallel size).
        staged: whether its receivers stage transfers in host memory (the model is written
            at the commit only) or stream them into the model.
        control_timeout_s: bound of calls that carry no deadline of their own.
        grace_s: added to a call's own deadline before vLLM gives up waiting for the workers.
    """

    def __init__(
        self,
        client: VllmClient,
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
        self.gate = VllmGate(client, self.label)
        self._staged = staged
        self._control_timeout_s = control_timeout_s
        self._grace_s = grace_s
        self._pending: dict[int, tuple[EngineCall[Any], Future[Any]]] = {}
        self._pending_lock = threading.Lock()
        self._rpc_lock = threading.Lock()

    def submit(self, rank: int, call: EngineCall[Any]) -> Future[Any]:
        """Queue ``rank``'s call; the last worker's call starts the RPC. Never blocks."""
        future: Future[Any] = Future()
        with self._pending_lock:
            kinds = {type(c) for c, _ in self._pending.values()}
            if rank in self._pending or kinds - {type(call)}:
                self._fail_pending(call.operation)
            self._pending[rank] = (call, future)
            if len(self._pending) < self.workers:
                return future
            batch, self._pending = self._pending, {}
        in_thread(self._run, batch, name=f"refit-{self.label}-{call.operation}")
        return future

    def _fail_pending(self, operation: str) -> None:
        """Fail a batch that ``operation`` interrupts (the synchronizer calls every worker)."""
        for rank, (waiting, future) in self._pending.items():
            future.set_exception(
                RefitError(
                    f"{self.label} rank {rank}: {waiting.operation} was not called on every "
                    f"worker before {operation}"
                )
            )
        self._pending = {}

    def _run(self, batch: Mapping[int, tuple[EngineCall[Any], Future[Any]]]) -> None:
        calls = [batch[rank][0] for rank in range(self.workers)]
        call = calls[0]
        try:
            if call.stages(self._staged):
                outcomes = self._outcomes(call, self._staging_replies(calls))
            else:
                with self._rpc_lock:
                    if call.pauses(self._staged):
                        self.gate.close()
                    paused = time.perf_counter()
                    bound = call.rpc_timeout_s(self._control_timeout_s, self._grace_s)
                    outcomes = self._outcomes(call, self._rpc(calls, bound))
                if not any(isinstance(o, Exception) for o in outcomes):
                    # The engine was paused from ``paused`` until the outcomes reopened it.
                    held_s = time.perf_counter() - paused
                    outcomes = [call.timed(o, held_s) for o in outcomes]
        except Exception as exc:
            state = EngineState.CLOSED if self.gate.closed else EngineState.UNKNOWN
            report = EngineReport(self.shard, self.label, state, None, str(exc))
            error = with_engines(
                WorkerError(
                    f"{type(exc).__name__}: {exc}", worker=self.label, operation=call.operation
                ),
                [report],
            )
            for _, future in batch.values():
                future.set_exception(error)
            return
        for rank, (_, future) in batch.items():
            outcome = outcomes[rank]
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def _rpc(
        self, calls: Sequence[EngineCall[Any]], timeout_s: float | None
    ) -> list[WorkerReply[Any]]:
        """Each worker's call (``calls[rank]``), in one RPC; their replies in rank order.

        Raises:
            ProtocolError: a worker answered with something other than a reply.
        """
        requests = [encode(c) for c in calls]
        replies = self.gate.client.collective_rpc("refit_nccl_call", timeout_s, (requests,))
        return [reply_from_bytes(r, f"{self.label} rank {i}") for i, r in enumerate(replies)]

    def _staging_replies(self, calls: Sequence[EngineCall[Any]]) -> list[WorkerReply[Any]]:
        """Start the staging on every worker, then poll them until each ended; the replies.

        Raises:
            RefitTimeoutError: a worker still stages past the call's deadline plus grace.
        """
        timeout_s = calls[0].rpc_timeout_s(self._control_timeout_s, self._grace_s)
        ends = None if timeout_s is None else time.monotonic() + timeout_s
        with self._rpc_lock:
            replies = self._rpc(calls, self._control_timeout_s)
        polls = [Staging()] * self.workers
        while all(r.ok for r in replies):
            time.sleep(STAGING_POLL_S)
            with self._rpc_lock:
                replies = self._rpc(polls, self._control_timeout_s)
            if not any(r.ok and r.result is None for r in replies):
                break
            if ends is not None and time.monotonic() > ends:
                raise RefitTimeoutError(f"{self.label}: still staging past its deadline")
        return replies

    def _outcomes(self, call: EngineCall[Any], replies: list[WorkerReply[Any]]) -> list[Any]:
        """Each rank's result or error; opens the engine where the call allows it."""
        if len(replies) != self.workers:
            raise RefitError(f"{self.label}: {len(replies)} workers answered, not {self.workers}")
        outcomes: list[Any] = []
        for rank, reply in enumerate(replies):
            try:
                outcomes.append(reply.unwrap(f"{self.label} rank {rank}", call.operation))
            except RefitError as exc:
                outcomes.append(exc)
        if not call.writes:
            return outcomes
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if not failed:
            served = call.served(outcomes[0])
            if served is not None:
                self.gate.open(served)
            return outcomes
        partial = any(r.partial for r in replies)
        report = self.gate.settle(self.shard, partial=partial, reason=str(failed[0]))
        logger.warning("%s: %s failed; engine %s", self.label, call.operation, report.state.value)
        return [with_engines(o, [report]) if isinstance(o, RefitError) else o for o in outcomes]


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
        return self._engine.submit(self._rank, engine_call(name, args))

    def close(self) -> None:
        """Nothing to release: the engine belongs to whoever started it."""


class VllmCollectiveGeneration:
    """vLLM engines as a :class:`~refit_nccl.controller.builder.CollectiveGeneration`: shard ``i`` is
    ``engines[i]``, one participant per worker (tensor-parallel rank), each receiving every
    checkpoint tensor whole (vLLM's loader keeps the rank's slice).

    Args:
        engines: engines started with :func:`refit_nccl.vllm.engine_args`, in shard order:
            offline ``vllm.LLM`` objects or clients (:class:`~refit_core.vllm.AsyncVllm` for
            an ``AsyncLLM``, which stages while it serves).
        staged: stage each transfer in host memory and write the model only at the commit
            (a failed transfer leaves every engine on its old version; memory: one host copy
            of the checkpoint per worker), or stream it into the model (no extra memory; an
            engine whose transfer fails after its first bucket stays closed until a complete
            refit).
        buffer_size_bytes: bucket size every worker declares, at least 1 MiB
            (``refit_core.backend.MIN_BUFFER_BYTES``; None: refit-nccl's default, 1 GiB on a
            GPU worker, 64 MiB on a CPU one).
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
        init: dict[str, Any] = {"staged": staged}
        if buffer_size_bytes is not None:
            init["buffer_size_bytes"] = checked_buffer_size(buffer_size_bytes)
        self._shards: dict[int, list[Participant[CollectiveEngineRole]]] = {}
        for shard, llm in enumerate(engines):
            client = vllm_client(llm)
            workers = len(
                client.collective_rpc("init_weight_transfer_engine", control_timeout_s, (init,))
            )
            engine = _EngineCalls(
                client,
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
