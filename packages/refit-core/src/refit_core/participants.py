"""Controller-side handles on the participants of a refit (trainer ranks, engine workers).

A participant is an endpoint (refit-nccl's trainer and engine endpoints, refit-zmq's shard
producers) reached either as a Ray actor or as an object in the controller's own process;
both answer ``call(method, *args)`` with a future, so the controller waits on all of them
with one timeout and never blocks on one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ActorParticipant",
    "Gathered",
    "LocalParticipant",
    "Participant",
    "gather",
    "root_cause",
]

logger = logging.getLogger(__name__)


class Participant(ABC):
    """One trainer rank or engine worker, as the controller reaches it."""

    def __init__(self, label: str) -> None:
        self.label = label

    @property
    @abstractmethod
    def key(self) -> Hashable:
        """Identity of the process behind it: a restarted worker has another key."""

    @abstractmethod
    def call(self, method: str, *args: object) -> Future[Any]:
        """Invoke ``method(*args)`` on the endpoint; never blocks."""

    @abstractmethod
    def close(self) -> None:
        """Release controller-side resources (not the endpoint)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


class ActorParticipant(Participant):
    """An endpoint running as a Ray actor (create it with ``max_concurrency >= 2``)."""

    def __init__(self, handle: Any, label: str) -> None:
        super().__init__(label)
        self._handle = handle

    @property
    def key(self) -> Hashable:
        """The actor handle (Ray compares handles by actor id)."""
        key: Hashable = self._handle
        return key

    def call(self, method: str, *args: object) -> Future[Any]:
        """``handle.method.remote(*args)`` as a future."""
        future: Future[Any] = getattr(self._handle, method).remote(*args).future()
        return future

    def close(self) -> None:
        """Nothing to release: the actor belongs to whoever created it."""


class LocalParticipant(Participant):
    """An endpoint object in the controller's process, called on its own threads."""

    def __init__(self, endpoint: object, label: str) -> None:
        super().__init__(label)
        self._endpoint = endpoint
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"refit-{label}")

    @property
    def key(self) -> Hashable:
        """The endpoint object."""
        return id(self._endpoint)

    def call(self, method: str, *args: object) -> Future[Any]:
        """Run ``endpoint.method(*args)`` on a worker thread."""
        return self._executor.submit(getattr(self._endpoint, method), *args)

    def close(self) -> None:
        """Stop taking calls; calls already submitted (an abort) still run, and a call still
        running ends by its own deadline."""
        self._executor.shutdown(wait=False)


@dataclass
class Gathered:
    """What a set of calls returned by the timeout: results, errors, and who never answered."""

    results: dict[Participant, Any] = field(default_factory=dict)
    errors: dict[Participant, BaseException] = field(default_factory=dict)
    missing: list[Participant] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every call returned."""
        return not self.errors and not self.missing


def _exception(future: Future[Any]) -> BaseException:
    error = future.exception()
    assert error is not None
    return error


def root_cause(error: BaseException) -> BaseException:
    """The participant's own exception inside a transport wrapper (Ray's ``cause``)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def gather(
    calls: Mapping[Participant, Future[Any]],
    timeout_s: float | None,
    *,
    settle_at: float | None = None,
    settle_s: float | None = None,
    on_failure: Callable[[Participant, BaseException], None] | None = None,
) -> Gathered:
    """Wait for ``calls`` and sort their outcomes.

    Args:
        calls: one future per participant.
        timeout_s: the longest wait (None: no limit).
        settle_at: a ``time.monotonic()`` instant (the deadline plus the time participants
            need to release themselves): once it has passed and some call has failed, stop
            waiting for the rest; they are frozen or dead, and the refit has failed anyway.
        settle_s: once a call has failed, wait at most this much longer for the rest.
        on_failure: called once, with the first failed participant and its error, as soon
            as that failure is seen (for example to abort the others' calls).
    """
    end = None if timeout_s is None else time.monotonic() + timeout_s
    owner = {future: participant for participant, future in calls.items()}
    pending = set(calls.values())
    failed_at: float | None = None
    while pending:
        limit = end
        if failed_at is not None:
            for settle in (settle_at, None if settle_s is None else failed_at + settle_s):
                if settle is not None:
                    limit = settle if limit is None else min(limit, settle)
        wait_s = None if limit is None else limit - time.monotonic()
        if wait_s is not None and wait_s <= 0:
            break
        done, pending = concurrent.futures.wait(
            pending, timeout=wait_s, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        first = next((f for f in done if f.exception() is not None), None)
        if first is not None and failed_at is None:
            failed_at = time.monotonic()
            if on_failure is not None:
                on_failure(owner[first], root_cause(_exception(first)))
    gathered = Gathered()
    for participant, future in calls.items():
        if not future.done():
            gathered.missing.append(participant)
            continue
        error = future.exception()
        if error is None:
            gathered.results[participant] = future.result()
        else:
            gathered.errors[participant] = root_cause(error)
    if not gathered.ok:
        logger.warning(
            "calls failed on %s; no answer from %s",
            {p.label: f"{type(e).__name__}: {e}" for p, e in gathered.errors.items()},
            [p.label for p in gathered.missing],
        )
    return gathered
