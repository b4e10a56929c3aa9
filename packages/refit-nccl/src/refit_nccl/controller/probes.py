"""The engines' statuses as the controller asks for them (:class:`StatusProbe`): every engine
at once, a frozen one never asked twice, a dead one remembered."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from refit_core import EngineHealth, EngineStatus
from refit_core.backend import Gathered, Participant, gather
from refit_nccl.roles.contract import CollectiveEngineRole, WorkerRefitStatus

__all__ = ["StatusProbe", "died", "engine_status", "one_line"]

logger = logging.getLogger(__name__)


def died(error: BaseException) -> bool:
    """Whether a participant's call failed because its process is gone (Ray's
    ``ActorDiedError``): it will never answer again, and no retry brings it back."""
    return any(kind.__name__ == "ActorDiedError" for kind in type(error).__mro__)


def one_line(error: BaseException | None) -> str:
    """An error's type and the first line of its message, for headlines and details."""
    if error is None:
        return "no answer (wedged or dead)"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


class StatusProbe:
    """Asks engine workers for their refit status.

    Args:
        probe_s: how long one probe waits for the answers.
    """

    def __init__(self, probe_s: float) -> None:
        self.probe_s = probe_s
        self._pending: dict[Hashable, Future[WorkerRefitStatus]] = {}
        self._dead: dict[Hashable, BaseException] = {}

    def ask(
        self, workers: Sequence[Participant[CollectiveEngineRole]], wait_s: float | None = None
    ) -> Gathered:
        """Each worker's status within ``wait_s`` (default: the probe timeout), all asked at
        once. A worker whose last status call is still unanswered (frozen) is not asked
        again, that call is awaited instead, so calls never pile up on it; a worker whose
        actor died is remembered (its death reported, not asked or logged again)."""
        calls: dict[Participant[Any], Future[WorkerRefitStatus]] = {}
        for worker in workers:
            if worker.key in self._dead:
                continue
            pending = self._pending.get(worker.key)
            if pending is None or pending.done():
                pending = self._pending[worker.key] = worker.call(CollectiveEngineRole.refit_status)
            calls[worker] = pending
        answered = gather(calls, self.probe_s if wait_s is None else wait_s)
        for worker, error in answered.errors.items():
            if died(error):
                logger.warning("%s died: %s", worker.label, one_line(error))
                self._dead[worker.key] = error
                self._pending.pop(worker.key, None)
        for worker in workers:
            if worker.key in self._dead:
                answered.errors[worker] = self._dead[worker.key]
        return answered


def engine_status(
    shard: int, worker: Participant[CollectiveEngineRole], gathered: Gathered
) -> EngineStatus:
    """One worker's entry of the fleet status, from what a probe gathered."""
    label = worker.label
    if worker in gathered.missing or worker in gathered.errors:
        detail = one_line(gathered.errors.get(worker))
        return EngineStatus(shard, label, EngineHealth.UNREACHABLE, detail=detail)
    status = gathered.results[worker]
    if status.closed:
        reason = status.abort_cause or "its weights changed since the last commit"
        return EngineStatus(
            shard, label, EngineHealth.CLOSED, detail=reason, began_version=status.began_version
        )
    return EngineStatus(
        shard,
        label,
        EngineHealth.SERVING,
        status.committed_version,
        status.staged_version,
        began_version=status.began_version,
    )
