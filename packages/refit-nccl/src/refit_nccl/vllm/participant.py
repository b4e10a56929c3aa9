"""The controller's handle on a vLLM engine taking part in a collective refit.

:class:`VllmEngineParticipant` forwards the synchronizer's endpoint calls to the engine's
worker through ``LLM.collective_rpc`` (one call at a time per engine, on a thread of its own,
so the controller never blocks), and after a commit resets the scheduler's prefix cache and
reports the weight version to vLLM. :class:`VllmCollectiveGeneration` lists such engines as
the shards ``build_collective_synchronizer`` expects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from refit_core import WorkerError
from refit_core.backend import Participant, in_thread, method_name
from refit_nccl.roles import CollectiveEngineRole, JoinRequest
from refit_nccl.vllm.calls import decode_reply, encode_call

__all__ = ["VllmCollectiveGeneration", "VllmEngineParticipant"]

logger = logging.getLogger(__name__)

_COMMIT = method_name(CollectiveEngineRole.refit_commit)
_TRANSFER = method_name(CollectiveEngineRole.refit_transfer)
_JOIN = method_name(CollectiveEngineRole.refit_join)


class VllmEngineParticipant(Participant[CollectiveEngineRole]):
    """One single-worker vLLM engine (``vllm.LLM``) as a collective participant.

    Args:
        llm: an engine started with refit-nccl's receiver (:func:`refit_nccl.vllm.engine_args`).
        label: how errors name it.
        control_timeout_s: bound of calls that carry no deadline of their own.
        grace_s: added to a call's own deadline before vLLM gives up waiting for the worker.
    """

    def __init__(
        self, llm: Any, label: str, *, control_timeout_s: float = 120.0, grace_s: float = 30.0
    ) -> None:
        super().__init__(label)
        self._llm = llm
        self._control_timeout_s = control_timeout_s
        self._grace_s = grace_s
        self._lock = threading.Lock()

    @property
    def key(self) -> Hashable:
        """The engine object: a restarted engine is another object."""
        return id(self._llm)

    def _start(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        """Run the endpoint call on the engine's worker; never blocks.

        Raises:
            TypeError: keyword arguments (calls cross vLLM's RPC positionally).
        """
        if kwargs:
            raise TypeError(f"{name}: calls over vLLM's RPC take positional arguments only")
        thread = f"refit-{self.label}-{name}"
        return in_thread(self._run, name, args, name=thread)

    def close(self) -> None:
        """Nothing to release: the engine belongs to whoever started it."""

    def _run(self, method: str, args: tuple[Any, ...]) -> Any:
        request = encode_call(method, args)
        with self._lock:  # one RPC at a time: a queued abort waits for the transfer's end
            replies = self._llm.collective_rpc(
                "refit_nccl_call", timeout=self._timeout_s(method, args), args=(request,)
            )
            if len(replies) != 1:
                raise WorkerError(
                    f"{len(replies)} workers answered; refit-nccl's vLLM receiver serves "
                    "single-worker engines (one participant per worker)",
                    worker=self.label,
                    operation=method,
                )
            result = decode_reply(replies[0], self.label, method)
            if method == _COMMIT:
                self._llm.reset_prefix_cache()
                self._llm.llm_engine.set_weight_version(str(result))
                logger.info("%s: serving version %s", self.label, result)
            return result

    def _timeout_s(self, method: str, args: tuple[Any, ...]) -> float | None:
        """The RPC's bound: the call's own deadline plus grace, else the control timeout."""
        if method == _TRANSFER:
            left: float | None = args[1]
        elif method == _JOIN and isinstance(args[0], JoinRequest):
            left = args[0].timeout_s
        else:
            return self._control_timeout_s
        return None if left is None else left + self._grace_s


class VllmCollectiveGeneration:
    """vLLM engines as a :class:`~refit_nccl.builder.CollectiveGeneration`: shard ``i`` is
    ``engines[i]``, one worker each.

    Args:
        engines: the ``vllm.LLM`` objects, in shard order.
        control_timeout_s: see :class:`VllmEngineParticipant`.
    """

    def __init__(self, engines: Sequence[Any], *, control_timeout_s: float = 120.0) -> None:
        self._participants = [
            VllmEngineParticipant(llm, f"vllm engine {i}", control_timeout_s=control_timeout_s)
            for i, llm in enumerate(engines)
        ]

    def collective_shards(self) -> Mapping[int, Sequence[Participant[CollectiveEngineRole]]]:
        """Shard index -> its one participant (the same objects on every call)."""
        return {i: [p] for i, p in enumerate(self._participants)}
