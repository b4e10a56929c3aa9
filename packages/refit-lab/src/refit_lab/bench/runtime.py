"""Generic helpers for benches: deadlines, free ports, bounded child processes, torch threads."""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Self, TypeVar

from refit_lab.faults import stop_process

logger = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_S = 0.1
_JOIN_GRACE_S = 5.0
_KILL_WAIT_S = 2.0


def default_threads() -> int:
    """CPU cores this process may run on (the default thread count of benches)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Deadline:
    """A point in time after which `check` raises `TimeoutError` naming what ran late."""

    def __init__(self, timeout_s: float, what: str) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.what = what
        self._end = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self._end - time.monotonic())

    def remaining(self) -> datetime.timedelta:
        """Seconds left as a timedelta (for torch.distributed timeouts)."""
        return datetime.timedelta(seconds=self.remaining_s())

    def check(self) -> None:
        """Raise `TimeoutError` once the deadline has passed."""
        if self.remaining_s() <= 0:
            raise TimeoutError(f"{self.what} exceeded its {self.timeout_s:.1f} s deadline")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind to port 0 when you can instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with `threads` torch intra-op threads, restoring the previous count."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _mp_context() -> (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
):
    """Forkserver with torch preloaded, so children start in milliseconds; spawn where absent."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        forkserver = multiprocessing.get_context("forkserver")
        forkserver.set_forkserver_preload(["torch"])
        return forkserver
    return multiprocessing.get_context("spawn")


def _child_main(
    target: Callable[..., object],
    conn: multiprocessing.connection.Connection,
    args: tuple[object, ...],
) -> None:
    """Entry point of a child: run `target`, send (ok, result or traceback) to the parent."""
    try:
        result = target(*args)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        raise
    else:
        conn.send((True, result))
    finally:
        conn.close()


class ChildGroup(Generic[T]):
    """Child processes that each run `target(*args)` and report its result through a pipe.

    Use as a context manager. Nothing waits past `deadline`; on exit every child still alive is
    terminated, then killed, so a failed or frozen child never outlives the block. As with spawn,
    `target` must be importable by name and a main script must guard with `__name__ == "__main__"`.
    """

    def __init__(
        self,
        target: Callable[..., T],
        args: Sequence[tuple[object, ...]],
        *,
        deadline: Deadline,
        name: str,
    ) -> None:
        self._target = target
        self._args = list(args)
        self._deadline = deadline
        self._name = name
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._results: dict[int, T] = {}

    def __enter__(self) -> Self:
        mp = _mp_context()
        try:
            for index, args in enumerate(self._args):
                recv_end, send_end = mp.Pipe(duplex=False)
                proc = mp.Process(
                    target=_child_main,
                    args=(self._target, send_end, args),
                    name=f"{self._name}-{index}",
                    daemon=True,
                )
                proc.start()
                send_end.close()
                self._procs.append(proc)
                self._conns.append(recv_end)
        except BaseException:
            self._stop()
            raise
        logger.debug("started %d %s children", len(self._procs), self._name)
        return self

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        self._stop(grace_s=0.0 if exc is not None else _JOIN_GRACE_S)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Collect results that arrive within `timeout_s`; raise if a child failed or died."""
        pending = [conn for i, conn in enumerate(self._conns) if i not in self._results]
        for conn in multiprocessing.connection.wait(pending, timeout=timeout_s):
            assert isinstance(conn, multiprocessing.connection.Connection)
            index = self._conns.index(conn)
            proc = self._procs[index]
            try:
                ok, payload = conn.recv()
            except EOFError:
                proc.join(_KILL_WAIT_S)
                raise ChildProcessError(
                    f"{proc.name} exited (code {proc.exitcode}) without a result"
                ) from None
            if not ok:
                raise ChildProcessError(f"{proc.name} failed:\n{payload}")
            self._results[index] = payload

    def results(self) -> list[T]:
        """Wait (within the deadline) for every child's result, in child order."""
        while len(self._results) < len(self._conns):
            self._deadline.check()
            self.poll(min(_POLL_S, self._deadline.remaining_s()))
        return [self._results[i] for i in range(len(self._conns))]

    def _stop(self, grace_s: float = 0.0) -> None:
        for proc in self._procs:
            stop_process(proc, min(grace_s, self._deadline.remaining_s()), wait_s=_KILL_WAIT_S)
        for conn in self._conns:
            conn.close()
