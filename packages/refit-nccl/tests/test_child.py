"""The child-process communicator (``ChildProcessGroup``) with real processes over gloo.

Ranks 0 and 1 run their communicators in spawned children; rank 2 runs in process (the
groups interoperate: the child runs the same group). Checked: calls, abort twice, call after
abort, a bitwise packed broadcast, every survivor released within deadline + 1 s when rank 2
is frozen (SIGSTOP) in the middle of a 76 MiB transfer, and a retry over the survivors (a
reconcile: fresh children).
"""

from __future__ import annotations

import pytest
import torch

from nccl_workers import RELEASE_SLACK_S, Report, by_event, launch_child_session
from refit_core import RefitAbortedError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_lab.faults import ProcessGang
from refit_lab.ray_cluster import free_port
from refit_nccl.group.child.process_group import ChildProcessGroup
from refit_nccl.group.spec import GroupSpec


@pytest.fixture(scope="module")
def reports() -> list[Report]:
    with ProcessGang() as gang:
        expected = launch_child_session(gang)
        found: list[Report] = gang.collect(expected, timeout_s=420)
    return found


def _ranks(reports: list[Report], scenario: str, event: str) -> dict[int, Report]:
    return by_event(reports, scenario, event)


@pytest.mark.timeout(500)
def test_calls_abort_twice_and_call_after_abort(reports: list[Report]) -> None:
    calls = _ranks(reports, "calls", "calls")
    assert set(calls) == {0, 1, 2}
    for rank, report in calls.items():
        assert report["sum"] == 6.0 and report["max"] == 2.0
        assert report["broadcast"] == list(range(10))
        assert report["cause"] == "first abort" and report["connected"] is False
        if rank == 1:
            assert report["ring"] == [0.0, 0.0, 0.0]
    for report in _ranks(reports, "calls", "after_abort").values():
        assert report["error"] == "RefitAbortedError" and "first abort" in report["message"]


@pytest.mark.timeout(500)
def test_packed_broadcast_through_the_child_is_bitwise(reports: list[Report]) -> None:
    broadcast = _ranks(reports, "broadcast", "broadcast")
    assert set(broadcast) == {0, 1, 2}
    assert all(report["wrong"] == [] for report in broadcast.values())


@pytest.mark.timeout(500)
def test_frozen_peer_releases_every_survivor_within_deadline_plus_1s(
    reports: list[Report],
) -> None:
    transfer = _ranks(reports, "survivor", "SIGSTOP:transfer")
    assert set(transfer) == {0, 1}
    for rank, report in transfer.items():
        assert report["error"] == "RefitTimeoutError", f"rank {rank}: {report}"
        assert report["after_deadline_s"] <= RELEASE_SLACK_S, f"rank {rank} released late"
    for report in _ranks(reports, "survivor", "SIGSTOP:after_abort").values():
        assert report["error"] == "RefitAbortedError"
    assert not [r for r in reports if r["event"] == "victim survived"]


@pytest.mark.timeout(500)
def test_retry_over_fresh_children_is_bitwise(reports: list[Report]) -> None:
    retry = _ranks(reports, "survivor", "SIGSTOP:retry")
    assert set(retry) == {0, 1} and retry[1]["wrong"] == []


def test_cuda_communicators_are_refused() -> None:
    with pytest.raises(ValueError, match="CUDA IPC"):
        ChildProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 2, "nccl"))


def test_abort_of_a_never_connected_group_spawns_nothing() -> None:
    group = ChildProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 2))
    group.abort("never connected")
    group.abort("again")
    with pytest.raises(RefitAbortedError, match="never connected"):
        group.connect(Deadline.after(5))


@pytest.mark.timeout(60)
def test_rendezvous_without_peers_kills_the_child_by_its_deadline() -> None:
    group = ChildProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 2))
    deadline = Deadline.after(1.0)
    with pytest.raises(RefitTimeoutError, match="rendezvous"):
        group.connect(deadline)
    assert deadline.at is not None
    assert group.aborted
    with pytest.raises(RefitAbortedError):
        group.all_reduce(torch.zeros(1), Deadline.after(1))
