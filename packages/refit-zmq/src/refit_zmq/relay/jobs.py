"""The relay's receiver thread: receiver calls run one at a time, off the event loop.

Each job's continuation runs on the event loop (``finish`` is called there after a wake-up),
so everything that touches sockets or relay state stays on one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["ReceiverJobs"]

Then = Callable[[Future[Any]], None]


class ReceiverJobs:
    """A single worker thread for receiver calls, with continuations for the event loop.

    Args:
        wake: called (from the worker thread) when a job is done, to wake the event loop.
        name: names the worker thread (``refit-relay-<name>``).
    """

    def __init__(self, wake: Callable[[], None], *, name: str = "receiver") -> None:
        self._wake = wake
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"refit-relay-{name}")
        self._pending: list[tuple[Future[Any], Then]] = []

    def submit(self, fn: Callable[[], Any], then: Then) -> None:
        """Run ``fn`` after every job submitted before it; ``then(future)`` on the loop after."""
        future = self._worker.submit(fn)
        future.add_done_callback(lambda _: self._wake())
        self._pending.append((future, then))

    def finish(self) -> None:
        """Run the continuations of the jobs that are done (on the event loop)."""
        done = [job for job in self._pending if job[0].done()]
        for job in done:
            self._pending.remove(job)
            future, then = job
            then(future)

    def close(self) -> None:
        """Wait for the running job; drop the queued ones."""
        self._worker.shutdown(wait=True, cancel_futures=True)
