"""The relay's receiver thread: receiver calls run one at a time, off the event loop.

Each job's continuation runs on the event loop (``finish`` is called there after a wake-up),
so everything that touches sockets or relay state stays on one thread. Jobs that only feed
bytes (``run``) have no continuation and cost one queue put: a payload's chunks are handed
over this way, several hundred per GiB.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["ReceiverJobs"]

logger = logging.getLogger(__name__)

Then = Callable[[Future[Any]], None]
_Job = tuple[Callable[[], Any], Future[Any] | None]


class ReceiverJobs:
    """A single worker thread for receiver calls, with continuations for the event loop.

    Args:
        wake: called (from the worker thread) when a job is done, to wake the event loop.
        name: names the worker thread (``refit-relay-<name>``).
    """

    def __init__(self, wake: Callable[[], None], *, name: str = "receiver") -> None:
        self._wake = wake
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._pending: list[tuple[Future[Any], Then]] = []
        self._closing = False
        self._worker = threading.Thread(target=self._work, name=f"refit-relay-{name}", daemon=True)
        self._worker.start()

    def submit(self, fn: Callable[[], Any], then: Then) -> None:
        """Run ``fn`` after every job submitted before it; ``then(future)`` on the loop after."""
        future: Future[Any] = Future()
        self._pending.append((future, then))
        self._queue.put((fn, future))

    def run(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` after every job submitted before it, without waking the loop after it
        (a failure is logged: ``fn`` must keep its own errors for a later job to report)."""
        self._queue.put((fn, None))

    def finish(self) -> None:
        """Run the continuations of the jobs that are done (on the event loop)."""
        done = [job for job in self._pending if job[0].done()]
        for job in done:
            self._pending.remove(job)
            future, then = job
            then(future)

    def close(self) -> None:
        """Wait for the running job; drop the queued ones."""
        self._closing = True
        self._queue.put(None)
        self._worker.join()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            fn, future = job
            if self._closing:
                if future is not None:
                    future.cancel()
                continue
            try:
                result = fn()
            except BaseException as exc:
                if future is None:
                    logger.error("receiver job failed", exc_info=exc)
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)
            if future is not None:
                self._wake()
