"""Future helpers for participants whose engine calls run on daemon threads.

A participant's ``call`` must never block, so one that drives an engine over HTTP starts each
call on a thread of its own and answers with a future (refit-dynamo and refit-sglang do).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["dispatch", "done", "failed", "in_thread", "then"]

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


def dispatch(
    handlers: Mapping[str, Callable[..., Future[Any]]],
    method: str,
    args: tuple[Any, ...],
    what: str,
) -> Future[Any]:
    """Start ``handlers[method](*args)``; a failed future when ``what`` has no such method or
    the handler raises."""
    handler = handlers.get(method)
    if handler is None:
        return failed(NotImplementedError(f"{what} has no {method}"))
    try:
        return handler(*args)
    except Exception as exc:
        return failed(exc)
