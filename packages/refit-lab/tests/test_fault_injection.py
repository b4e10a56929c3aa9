"""Fault injection helpers: a gang of spawned processes, freezing, thawing, killing."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from refit_lab.faults import ProcessGang, after, fault_self, freeze, frozen, kill, thaw


def state_of(pid: int) -> str:
    """The process state letter from /proc (R, S, T stopped, Z zombie)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(60)
def test_freeze_thaw_and_kill_a_spawned_process() -> None:
    with ProcessGang() as gang:
        pid = gang.spawn(time.sleep, 30).pid
        assert pid is not None
        freeze(pid)
        assert wait_for(lambda: state_of(pid) == "T")
        thaw(pid)
        assert wait_for(lambda: state_of(pid) in "RS")
        with frozen(pid):
            assert wait_for(lambda: state_of(pid) == "T")
        assert wait_for(lambda: state_of(pid) in "RS")
        kill(pid)
        assert gang.join(10) == [-signal.SIGKILL]
    kill(pid)  # already gone: ignored


@pytest.mark.timeout(60)
def test_reap_ends_a_process_that_froze_itself() -> None:
    gang = ProcessGang()
    with gang:
        process = gang.spawn(fault_self, signal.SIGSTOP)
        pid = process.pid
        assert pid is not None
        assert wait_for(lambda: state_of(pid) == "T", timeout_s=30)
    assert not process.is_alive() and process.exitcode == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_collect_returns_results_and_times_out_on_missing_ones() -> None:
    with ProcessGang() as gang:
        gang.spawn(gang.results.put, "hello")
        assert gang.collect(1, timeout_s=30) == ["hello"]
        with pytest.raises(TimeoutError, match="0 of 1"):
            gang.collect(1, timeout_s=0.2)


@pytest.mark.timeout(10)
def test_after_runs_once_later_and_can_be_cancelled() -> None:
    fired: list[int] = []
    timer = after(0.05, lambda: fired.append(1))
    timer.join(5)
    assert fired == [1]
    cancelled = after(5.0, lambda: fired.append(2))
    cancelled.cancel()
    assert fired == [1]
