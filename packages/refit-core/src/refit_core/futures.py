"""Future helpers: a participant's call never blocks, so work that waits on an engine runs on a
daemon thread of its own and is answered with a future.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["InFlight", "done", "failed", "in_thread", "then"]

_T = TypeVar("_T")
_U = TypeVar("_U")


def done(value: _T) -> Future[_T]:
    """A future already holding ``value``."""
    future: Future[_T] = Future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future[Any]:
    """A future already holding ``error``."""
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


def in_thread(fn: Callable[..., _T], *args: Any, name: str) -> Future[_T]:
    """Run ``fn(*args)`` on a daemon thread called ``name`` (every call it makes must have a
    timeout)."""
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def then(source: Future[_T], fn: Callable[[_T], _U]) -> Future[_U]:
    """A future of ``fn(source's result)``, failing as ``source`` fails."""
    target: Future[_U] = Future()

    def relay(finished: Future[_T]) -> None:
        error = finished.exception()
        if error is not None:
            target.set_exception(error)
            return
        try:
            target.set_result(fn(finished.result()))
        except Exception as exc:
            target.set_exception(exc)

    source.add_done_callback(relay)
    return target


class InFlight:
    """Counts calls in flight across threads: ``with in_flight:`` around each call, and
    ``bool(in_flight)`` says whether one is still running (an abort that cannot reach the
    engine then says so)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def __enter__(self) -> None:
        with self._lock:
            self._count += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with self._lock:
            self._count -= 1

    def __bool__(self) -> bool:
        return self._count > 0
