"""Closing a vLLM engine while its weights are not one version, and reopening it on a version.

The failure rule of every vLLM row: an engine serves exactly one version, or nothing. Closed,
an engine's scheduler is paused in vLLM's ``keep`` mode (:meth:`VllmClient.pause`): requests
already admitted and requests submitted later are held, neither aborted nor answered, and no
forward pass runs; RPCs into its workers still run. Reopening on a new version drops every
prefix and KV block computed before (running requests are preempted and recompute their
prefix on the new weights), reports the version to vLLM and resumes.

A closed engine stays closed if the controller dies: only a later complete refit reopens it.
"""

from __future__ import annotations

import logging
from typing import Any

from refit_core.errors import EngineReport, EngineState
from refit_core.vllm.client import vllm_client

__all__ = ["VllmGate"]

logger = logging.getLogger(__name__)


class VllmGate:
    """Closes and reopens one vLLM engine.

    Args:
        engine: the engine: an offline ``vllm.LLM`` or a :class:`VllmClient`
            (:class:`~refit_core.vllm.client.AsyncVllm` for an ``AsyncLLM``).
        label: how logs name it.
    """

    def __init__(self, engine: Any, label: str) -> None:
        self.client = vllm_client(engine)
        self.label = label
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether this gate closed the engine and has not reopened it (known without asking
        the engine, which may be busy or dead)."""
        return self._closed

    def served_version(self) -> int | None:
        """The version vLLM reports (None: the weights it started on, or not a refit's)."""
        version = self.client.weight_version()
        return int(version) if version.isdigit() else None

    def close(self) -> None:
        """Hold every request (idempotent)."""
        self.client.pause()
        self._closed = True
        logger.info("%s: closed (requests held)", self.label)

    def open(self, version: int | None = None) -> None:
        """Resume generation: on ``version``, newly loaded (prefix cache and running requests'
        KV dropped, version reported), or on the weights it held before closing (None)."""
        if version is not None:
            self.client.drop_prefix_cache()
            self.client.set_weight_version(str(version))
        self.client.resume()
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
