"""A receiver dies (SIGKILL) or freezes (SIGSTOP) in the middle of a >= 64 MiB transfer.

Every survivor must raise RefitTimeoutError within deadline + 1 s, its group must refuse
further calls, a group rebuilt over the survivors must deliver bitwise, and a restarted
receiver must rejoin and be brought up to date. The processes are the shared gloo session of
conftest.py: two survivors live through both faults, each fault has its own victim.
"""

from __future__ import annotations

import pytest

from nccl_workers import FAULT_PARAMS, RELEASE_SLACK_S, SIGNALS, MiB, Report, by_event, mixed_state


@pytest.fixture(scope="module")
def reports(gloo_reports: list[Report]) -> list[Report]:
    return [r for r in gloo_reports if r["step"] is None]


def test_state_is_at_least_64_mib() -> None:
    state = mixed_state(
        FAULT_PARAMS["seed"], FAULT_PARAMS["filler_bytes"], FAULT_PARAMS["bucket_bytes"]
    )
    assert sum(t.numel() * t.element_size() for t in state.values()) >= 64 * MiB


@pytest.mark.timeout(280)
@pytest.mark.parametrize("signal_name", SIGNALS)
def test_every_survivor_raises_timeout_within_deadline_plus_1s(
    reports: list[Report], signal_name: str
) -> None:
    transfer = by_event(reports, "survivor", f"{signal_name}:transfer")
    assert set(transfer) == {0, 1}
    for rank, report in transfer.items():
        assert report["error"] == "RefitTimeoutError", f"rank {rank}: {report}"
        assert report["after_deadline_s"] <= RELEASE_SLACK_S, f"rank {rank} released late"
    assert not [r for r in reports if r["event"] == "victim survived"]


@pytest.mark.timeout(280)
@pytest.mark.parametrize("signal_name", SIGNALS)
def test_group_refuses_calls_after_the_fault(reports: list[Report], signal_name: str) -> None:
    after = by_event(reports, "survivor", f"{signal_name}:after_abort")
    assert set(after) == {0, 1}
    for rank, report in after.items():
        assert report["error"] == "RefitAbortedError", f"rank {rank}: {report}"


@pytest.mark.timeout(280)
@pytest.mark.parametrize("signal_name", SIGNALS)
def test_rebuild_over_survivors_and_retry_is_bitwise(
    reports: list[Report], signal_name: str
) -> None:
    retry = by_event(reports, "survivor", f"{signal_name}:retry")
    assert set(retry) == {0, 1}
    assert retry[1]["wrong"] == []


@pytest.mark.timeout(280)
def test_restarted_receiver_rejoins_and_is_brought_up_to_date(reports: list[Report]) -> None:
    rejoin = by_event(reports, "survivor", "rejoin") | by_event(reports, "rejoin", "rejoin")
    assert set(rejoin) == {0, 1, 2}
    assert rejoin[1]["wrong"] == [] and rejoin[2]["wrong"] == []
