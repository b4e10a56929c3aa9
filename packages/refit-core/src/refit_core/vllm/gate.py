"""Closing a vLLM engine while its weights are not one version, and reopening it on a version.

The failure rule of every vLLM row: an engine serves exactly one version, or nothing. Closed,
an offline ``vllm.LLM`` engine's scheduler is paused in vLLM's ``keep`` mode
(``LLM.sleep(level=0, mode="keep")``): requests already admitted and requests submitted later
are held, neither aborted nor answered, and no forward pass runs; RPCs into its workers still
run. Reopening on a new version drops every prefix and KV block computed before (running
requests are preempted and recompute their prefix on the new weights), reports the version to
vLLM and resumes (``wake_up(tags=["scheduling"])``). ``AsyncLLM`` has the same pause as
``pause_generation(mode="keep")`` / ``resume_generation()``.

A closed engine stays closed if the controller dies: only a later complete refit reopens it.

vLLM's offline client sends every request and RPC on one ZMQ socket, which is not thread-safe,
while refit's controller calls run on threads of their own (a participant never blocks its
caller), possibly beside the application's own ``generate``. :func:`serialize_sends` puts a
lock around the client's one sending method, so concurrent senders queue instead of
corrupting the socket (which aborts the process).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from refit_core.errors import EngineReport, EngineState

__all__ = ["VllmGate", "serialize_sends"]

logger = logging.getLogger(__name__)


class VllmGate:
    """Closes and reopens one offline ``vllm.LLM`` engine.

    Args:
        llm: the engine.
        label: how logs name it.
    """

    def __init__(self, llm: Any, label: str) -> None:
        self._llm = llm
        self.label = label
        self._closed = False
        serialize_sends(llm)

    @property
    def closed(self) -> bool:
        """Whether this gate closed the engine and has not reopened it (known without asking
        the engine, which may be busy or dead)."""
        return self._closed

    def served_version(self) -> int | None:
        """The version vLLM reports (None: the weights it started on, or not a refit's)."""
        version = str(self._llm.llm_engine.get_weight_version())
        return int(version) if version.isdigit() else None

    def close(self) -> None:
        """Hold every request (idempotent)."""
        self._llm.sleep(level=0, mode="keep")
        self._closed = True
        logger.info("%s: closed (requests held)", self.label)

    def open(self, version: int | None = None) -> None:
        """Resume generation: on ``version``, newly loaded (prefix cache and running requests'
        KV dropped, version reported), or on the weights it held before closing (None)."""
        if version is not None:
            self._llm.reset_prefix_cache(reset_running_requests=True)
            self._llm.llm_engine.set_weight_version(str(version))
        self._llm.wake_up(tags=["scheduling"])
        self._closed = False
        logger.info("%s: open on version %s", self.label, version)

    def settle(self, shard: int | None, *, partial: bool, reason: str) -> EngineReport:
        """After a failed refit: keep the engine closed if its model was written (``partial``),
        else reopen it on the weights it holds; what it serves now."""
        if partial:
            if not self.closed:
                self.close()
            return EngineReport(shard, self.label, EngineState.CLOSED, None, reason)
        if self.closed:
            self.open()
        return EngineReport(shard, self.label, EngineState.OLD, self.served_version(), reason)


def serialize_sends(llm: Any) -> None:
    """Serialize the sends of ``llm``'s engine-core client (idempotent; a client without the
    single sending method of vLLM 0.32's ``SyncMPClient`` is left alone)."""
    client = llm.llm_engine.engine_core
    send = getattr(client, "_send_input", None)
    if send is None or getattr(send, "refit_serialized", False):
        if send is None:
            logger.warning("%s has no _send_input: its sends are not serialized", type(client))
        return
    lock = threading.Lock()

    @functools.wraps(send)
    def serialized(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return send(*args, **kwargs)

    serialized.refit_serialized = True  # type: ignore[attr-defined]
    client._send_input = serialized
