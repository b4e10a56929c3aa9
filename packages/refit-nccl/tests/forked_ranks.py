"""Run one job per rank in processes forked from a warm parent; one failure ends them all.

megatron-core takes about 18 s of CPU to import here, so the oracle imports it once in a
top-level launcher process and forks its ranks from there (plain, non-daemonic processes:
Megatron's checkpoint writer forks helpers of its own, which a daemonic process may not). Each
rank's stdout and stderr go to ``<log_dir>/<tag><rank>.log``. The first rank that exits
non-zero (or the deadline) kills the others at once, and the error carries the failed rank's
log, so a crashed rank never leaves its peers waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.05
LOG_TAIL = 4000


class RankFailedError(RuntimeError):
    """A rank exited non-zero or the ranks did not all finish in time."""


def run_ranks(
    world: int, job: Callable[[int], None], log_dir: Path, tag: str, timeout_s: float
) -> None:
    """Fork ``world`` processes running ``job(rank)``; return once all of them succeeded.

    Raises:
        RankFailedError: a rank failed (its log attached) or ``timeout_s`` passed (every log).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"{tag}{rank}.log" for rank in range(world)]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {_fork(rank, job, logs[rank]): rank for rank in range(world)}
    end = time.monotonic() + timeout_s
    try:
        while pids:
            for pid, rank in list(pids.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
                del pids[pid]
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    raise RankFailedError(f"{tag} rank {rank} exited {code}\n{_tail(logs[rank])}")
            if pids and time.monotonic() > end:
                late = sorted(pids.values())
                tails = "".join(_tail(logs[rank]) for rank in late)
                raise RankFailedError(
                    f"{tag}: ranks {late} still running after {timeout_s} s\n{tails}"
                )
            time.sleep(POLL_S)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)


def _fork(rank: int, job: Callable[[int], None], log: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = os.fdopen(fd, "w", buffering=1)  # also under pytest's capture
        job(rank)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _tail(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    return f"--- {log.name} ---\n{text[-LOG_TAIL:]}\n"
