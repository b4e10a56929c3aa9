"""The oracle's rank launcher: a failed or stuck rank ends every rank at once, with its log."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from forked_ranks import RankFailedError, run_ranks

SLACK_S = 5.0


def _crash_rank_1(rank: int) -> None:
    if rank == 1:
        print("rank 1 about to fail")
        raise ValueError("rank 1 fails")
    time.sleep(600)  # a peer waiting for rank 1 forever


def _write_rank(out: Path, rank: int) -> None:
    (out / f"{rank}.pid").write_text(str(os.getpid()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
def test_every_rank_runs_in_its_own_process(tmp_path: Path) -> None:
    run_ranks(3, lambda rank: _write_rank(tmp_path, rank), tmp_path, "ok", timeout_s=30)
    pids = {(tmp_path / f"{rank}.pid").read_text() for rank in range(3)}
    assert len(pids) == 3
    assert str(os.getpid()) not in pids


@pytest.mark.timeout(60)
def test_a_failed_rank_kills_its_peers_and_reports_its_log(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 exited 1") as failure:
        run_ranks(3, _crash_rank_1, tmp_path, "crash", timeout_s=30)
    assert time.monotonic() - started < SLACK_S
    assert "rank 1 about to fail" in str(failure.value)
    assert "ValueError: rank 1 fails" in str(failure.value)


@pytest.mark.timeout(60)
def test_ranks_past_the_timeout_are_killed(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=r"ranks \[0, 1\] still running after 1\.0 s"):
        run_ranks(2, lambda rank: time.sleep(600), tmp_path, "stuck", timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + SLACK_S
