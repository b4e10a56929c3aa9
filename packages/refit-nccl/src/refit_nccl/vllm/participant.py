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
    checked_buffer_size,
    in_thread,
    method_name,
    with_engines,
)
from refit_core.vllm import VllmClient, VllmGate, vllm_client
from refit_nccl.roles.contract import (
    CollectiveEngineRole,
    CollectiveStagingRole,
    CommitStats,
    JoinRequest,
)
from refit_nccl.vllm.calls import decode_reply, encode_call, reply_partial, reply_pending

__all__ = ["STAGING_POLL_S", "VllmCollectiveGeneration", "VllmWorkerParticipant"]

logger = logging.getLogger(__name__)

_COMMIT = method_name(CollectiveEngineRole.refit_commit)
_TRANSFER = method_name(CollectiveEngineRole.refit_transfer)
_JOIN = method_name(CollectiveEngineRole.refit_join)
_STAGE = method_name(CollectiveStagingRole.refit_stage)
_COMMIT_STAGED = method_name(CollectiveStagingRole.refit_commit_staged)
_WRITES = frozenset({_TRANSFER, _COMMIT, _STAGE, _COMMIT_STAGED})
_PAUSING = frozenset({_COMMIT, _COMMIT_STAGED})

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
            if method == _STAGE or (method == _TRANSFER and self._staged):
                outcomes = self._outcomes(method, self._staging_replies(requests, args))
            else:
                with self._rpc_lock:
                    if method in _PAUSING or (method == _TRANSFER and not self._staged):
                        self.gate.close()
                    paused = time.perf_counter()
                    replies = self._rpc("refit_nccl_call", self._timeout_s(method, args), requests)
                    outcomes = self._outcomes(method, replies)
                if method == _COMMIT_STAGED and not any(isinstance(o, Exception) for o in outcomes):
                    # The engine was paused from ``paused`` until the outcomes reopened it.
                    held_s = time.perf_counter() - paused
                    outcomes = [CommitStats(o.version, held_s) for o in outcomes]
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

    def _rpc(self, method: str, timeout_s: float | None, *args: Any) -> list[bytes]:
        """``method(*args)`` on every worker of the engine; their replies in rank order."""
        replies: list[bytes] = self.gate.client.collective_rpc(method, timeout_s, args)
        return replies

    def _staging_replies(self, requests: list[bytes], args: tuple[Any, ...]) -> list[bytes]:
        """Start the staging on every worker, then poll them until each ended; the replies
        (``args``: the version and the time left, as a transfer's).

        Raises:
            RefitTimeoutError: a worker still stages past the call's deadline plus grace.
        """
        timeout_s = self._timeout_s(_STAGE, args)
        ends = None if timeout_s is None else time.monotonic() + timeout_s
        with self._rpc_lock:
            replies = self._rpc("refit_nccl_call", self._control_timeout_s, requests)
        while not any(self._failed(r) for r in replies):
            time.sleep(STAGING_POLL_S)
            with self._rpc_lock:
                replies = self._rpc("refit_nccl_staging", self._control_timeout_s)
            if not any(reply_pending(r, self.label) for r in replies):
                break
            if ends is not None and time.monotonic() > ends:
                raise RefitTimeoutError(f"{self.label}: still staging past its deadline")
        return replies

    def _failed(self, reply: bytes) -> bool:
        try:
            decode_reply(reply, self.label, _STAGE)
        except RefitError:
            return True
        return False

    def _outcomes(self, method: str, replies: list[bytes]) -> list[Any]:
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
            elif method == _COMMIT_STAGED:
                self.gate.open(outcomes[0].version)
            return outcomes
        partial = any(reply_partial(r, self.label) for r in replies)
        report = self.gate.settle(self.shard, partial=partial, reason=str(failed[0]))
        logger.warning("%s: %s failed; engine %s", self.label, method, report.state.value)
        return [with_engines(o, [report]) if isinstance(o, RefitError) else o for o in outcomes]

    def _timeout_s(self, method: str, args: tuple[Any, ...]) -> float | None:
        """The RPC's bound: the call's own deadline plus grace, else the control timeout."""
        if method in (_TRANSFER, _STAGE):
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
            (``refit_core.backend.MIN_BUFFER_BYTES``; None: refit-nccl's default, 1 GiB).
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
