"""Controller-side handles on the participants of a refit (trainer ranks, engine workers).

A participant is an endpoint that plays a *role*, a ``Protocol`` whose methods the controller
calls (refit-nccl's trainer and engine roles, refit-zmq's shard producer). It is reached as a
Ray actor, as an object in the controller's own process, or over an engine's own RPC; every
kind answers ``call`` with a future, so the controller waits on all of them with one timeout
and never blocks on one.

Calls name the role's method itself, so they are type-checked against the role::

    producer: Participant[ShardProducerRole]
    future = producer.call(ShardProducerRole.refit_stream, order)  # Future[dict[str, int]]

A renamed method, a wrong argument or a method of another role is a type error; only the
method's name travels (pickled for Ray, as bytes over an engine's RPC).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from refit_core.futures import in_thread

__all__ = [
    "ActorParticipant",
    "Gathered",
    "LocalParticipant",
    "Participant",
    "gather",
    "method_name",
    "role_methods",
    "root_cause",
]

logger = logging.getLogger(__name__)

RoleT_co = TypeVar("RoleT_co", covariant=True)
_P = ParamSpec("_P")
_T = TypeVar("_T")


def method_name(method: Callable[..., Any]) -> str:
    """The name of a role's method (``Role.method``), as it travels to the endpoint.

    Raises:
        ValueError: ``method`` is not a public method of a class (a lambda, a function).
    """
    name = getattr(method, "__name__", "")
    owner, _, tail = getattr(method, "__qualname__", "").rpartition(".")
    if not owner or tail != name or not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"{method!r} is not a public method of a participant role")
    return name


def role_methods(role: type) -> frozenset[str]:
    """The public methods of a role, as names (what an RPC-based participant may forward)."""
    return frozenset(
        name for name in dir(role) if not name.startswith("_") and callable(getattr(role, name))
    )


class Participant(ABC, Generic[RoleT_co]):
    """One trainer rank or engine worker playing the role ``RoleT_co``, as the controller
    reaches it."""

    def __init__(self, label: str) -> None:
        self.label = label

    @property
    @abstractmethod
    def key(self) -> Hashable:
        """Identity of the process behind it: a restarted worker has another key."""

    def call(
        self,
        method: Callable[Concatenate[RoleT_co, _P], _T],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> Future[_T]:
        """Invoke the role's ``method(*args, **kwargs)`` on the endpoint; never blocks.

        Raises:
            ValueError: ``method`` is not a method of a role.
        """
        return self._start(method_name(method), args, kwargs)

    @abstractmethod
    def _start(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        """Start the endpoint's method ``name``; never blocks."""

    @abstractmethod
    def close(self) -> None:
        """Release controller-side resources (not the endpoint)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


class ActorParticipant(Participant[RoleT_co]):
    """An endpoint running as a Ray actor (create it with ``max_concurrency >= 2``).

    The actor handle is untyped; whoever builds the participant states its role
    (``ActorParticipant[ShardProducerRole](handle, label)``)."""

    def __init__(self, handle: Any, label: str) -> None:
        super().__init__(label)
        self._handle = handle

    @property
    def key(self) -> Hashable:
        """The actor handle (Ray compares handles by actor id)."""
        key: Hashable = self._handle
        return key

    def _start(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        """``handle.name.remote(*args, **kwargs)`` as a future."""
        future: Future[Any] = getattr(self._handle, name).remote(*args, **kwargs).future()
        return future

    def close(self) -> None:
        """Nothing to release: the actor belongs to whoever created it."""


class LocalParticipant(Participant[RoleT_co]):
    """An endpoint object in the controller's process; each call runs on a daemon thread of
    its own, so a call that blocks (a transfer) never delays another (its abort).

    Args:
        endpoint: the object playing the role.
        label: how errors name it.
        key: the identity of what the endpoint drives (default: the endpoint object), for
            endpoints rebuilt on every look at the fleet.
    """

    def __init__(self, endpoint: RoleT_co, label: str, *, key: Hashable | None = None) -> None:
        super().__init__(label)
        self._endpoint = endpoint
        self._key = id(endpoint) if key is None else key
        self._closed = False

    @property
    def endpoint(self) -> RoleT_co:
        """The object playing the role."""
        return self._endpoint

    @property
    def key(self) -> Hashable:
        """The key given, else the endpoint object's identity."""
        return self._key

    def _start(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        """Run ``endpoint.name(*args, **kwargs)`` on a thread of its own.

        Raises:
            RuntimeError: the participant was closed.
        """
        if self._closed:
            raise RuntimeError(f"{self.label}: participant closed")
        bound = getattr(self._endpoint, name)
        return in_thread(lambda: bound(*args, **kwargs), name=f"refit-{self.label}-{name}")

    def close(self) -> None:
        """Stop taking calls; calls already started (an abort) still run, and a call still
        running ends by its own deadline."""
        self._closed = True


@dataclass
class Gathered:
    """What a set of calls returned by the timeout: results, errors, and who never answered."""

    results: dict[Participant[Any], Any] = field(default_factory=dict)
    errors: dict[Participant[Any], BaseException] = field(default_factory=dict)
    missing: list[Participant[Any]] = field(default_factory=list)

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
    calls: Mapping[Participant[Any], Future[Any]],
    timeout_s: float | None,
    *,
    settle_at: float | None = None,
    settle_s: float | None = None,
    on_failure: Callable[[Participant[Any], BaseException], None] | None = None,
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
