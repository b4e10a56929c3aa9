"""Three gloo worker processes run every collective step once; each test checks its own.

The processes are the shared gloo session of conftest.py: sharing them keeps the suite fast
on a 2-core machine (each spends seconds importing torch); every step gets its own group on
its own port.
"""

from __future__ import annotations

import pytest

from nccl_workers import STEPS, WORLD, Report, by_event


@pytest.fixture(scope="module")
def reports(gloo_reports: list[Report]) -> dict[int, list[Report]]:
    """Step index -> reports of that step from every rank."""
    by_step: dict[int, list[Report]] = {}
    for report in gloo_reports:
        if report["step"] is not None:
            by_step.setdefault(report["step"], []).append(report)
    return by_step


def step(reports: dict[int, list[Report]], index: int, event: str) -> dict[int, Report]:
    found = by_event(reports.get(index, []), STEPS[index][0], event)
    assert set(found) == set(range(WORLD)), f"step {index}: ranks {sorted(found)} reported"
    return found


@pytest.mark.timeout(280)
def test_calls_abort_twice_and_call_after_abort(reports: dict[int, list[Report]]) -> None:
    calls = step(reports, 0, "calls")
    for rank, report in calls.items():
        assert report["sum"] == 6.0
        assert report["max"] == 2.0
        assert report["broadcast"] == list(range(10))
        assert report["cause"] == "first abort"
        assert report["connected"] is False
        if rank == 1:
            assert report["ring"] == [0.0, 0.0, 0.0]
    for report in step(reports, 0, "after_abort").values():
        assert report["error"] == "RefitAbortedError"
        assert "first abort" in report["message"]


@pytest.mark.timeout(280)
@pytest.mark.parametrize("index", [1, 2, 3], ids=["refit-mixed", "refit-3-buffers", "vllm-rule"])
def test_packed_broadcast_is_bitwise(reports: dict[int, list[Report]], index: int) -> None:
    for rank, report in step(reports, index, "broadcast").items():
        assert report["wrong"] == [], f"rank {rank} received wrong tensors"


@pytest.mark.timeout(280)
@pytest.mark.parametrize("index", [4, 5], ids=["geometry", "state"])
def test_plan_mismatch_is_refused_on_every_rank(
    reports: dict[int, list[Report]], index: int
) -> None:
    for report in step(reports, index, "handshake").values():
        assert report["error"] == "GeometryMismatchError"
        assert "plans differ" in report["message"]


@pytest.mark.timeout(280)
def test_matching_plans_pass_the_handshake(reports: dict[int, list[Report]]) -> None:
    for report in step(reports, 6, "handshake").values():
        assert report["error"] is None
