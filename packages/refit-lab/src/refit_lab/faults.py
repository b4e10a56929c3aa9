"""Fault injection for tests and benchmarks: kill, freeze, thaw, delay and stop processes.

:class:`ProcessGang` spawns worker processes (start method ``spawn``) and always reaps them:
on exit every survivor is thawed, killed and joined, so a failing test never leaves a frozen
or orphaned process behind. A worker can also fault itself at an exact point of its work
(:func:`fault_self`), which makes "in the middle of a transfer" deterministic.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.context import SpawnProcess
from typing import Any

__all__ = [
    "ProcessGang",
    "after",
    "fault_self",
    "freeze",
    "frozen",
    "kill",
    "stop_process",
    "thaw",
]

logger = logging.getLogger(__name__)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        logger.debug("process %d is already gone (%s)", pid, sig.name)


def kill(pid: int) -> None:
    """SIGKILL ``pid``; a process that is already gone is ignored."""
    _signal(pid, signal.SIGKILL)


def freeze(pid: int) -> None:
    """SIGSTOP ``pid``: alive but unresponsive until :func:`thaw`."""
    _signal(pid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    """SIGCONT ``pid``."""
    _signal(pid, signal.SIGCONT)


def stop_process(
    process: multiprocessing.process.BaseProcess, grace_s: float, *, wait_s: float
) -> bool:
    """Give ``process`` ``grace_s`` to exit, then terminate it, then kill it, waiting up to
    ``wait_s`` after each signal; whether it has exited."""
    process.join(grace_s)
    for action, send in (("terminating", process.terminate), ("killing", process.kill)):
        if not process.is_alive():
            return True
        logger.warning("%s %s (pid %s)", action, process.name, process.pid)
        send()
        process.join(wait_s)
    return not process.is_alive()


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Keep ``pid`` frozen for the duration of the block."""
    freeze(pid)
    try:
        yield
    finally:
        thaw(pid)


def fault_self(sig: signal.Signals) -> None:
    """Send ``sig`` to the calling process (SIGKILL: die here; SIGSTOP: freeze here)."""
    os.kill(os.getpid(), sig)


def after(delay_s: float, fault: Callable[[], None]) -> threading.Timer:
    """Run ``fault`` once, ``delay_s`` seconds from now, on a daemon timer (cancel to skip)."""
    timer = threading.Timer(delay_s, fault)
    timer.daemon = True
    timer.start()
    return timer


class ProcessGang:
    """Spawned worker processes that are always reaped; use as a context manager.

    Args:
        reap_timeout_s: how long to wait for each process to exit when reaping.
    """

    def __init__(self, *, reap_timeout_s: float = 10.0) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[SpawnProcess] = []
        self._reap_timeout_s = reap_timeout_s
        self.results: multiprocessing.Queue[Any] = self._context.Queue()

    @property
    def processes(self) -> list[SpawnProcess]:
        """Every process started, in start order."""
        return list(self._processes)

    def spawn(self, target: Callable[..., object], *args: object) -> SpawnProcess:
        """Start ``target(*args)`` in a new process."""
        process = self._context.Process(target=target, args=args, daemon=True)
        process.start()
        self._processes.append(process)
        return process

    def collect(self, count: int, timeout_s: float) -> list[Any]:
        """Take ``count`` items from :attr:`results`; TimeoutError if they do not all arrive."""
        end = time.monotonic() + timeout_s
        items: list[Any] = []
        while len(items) < count:
            try:
                items.append(self.results.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                raise TimeoutError(
                    f"{len(items)} of {count} results arrived within {timeout_s} s"
                ) from None
        return items

    def join(self, timeout_s: float) -> list[int | None]:
        """Wait up to ``timeout_s`` in all for every process; their exit codes (None: running)."""
        end = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, end - time.monotonic()))
        return [p.exitcode for p in self._processes]

    def reap(self) -> None:
        """Thaw, kill and join every process still alive."""
        for process in self._processes:
            if process.pid is not None and process.is_alive():
                thaw(process.pid)
                kill(process.pid)
        for process in self._processes:
            process.join(self._reap_timeout_s)
            if process.is_alive():
                logger.error("process %s survived SIGKILL", process.pid)
        self.results.close()

    def __enter__(self) -> ProcessGang:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.reap()
