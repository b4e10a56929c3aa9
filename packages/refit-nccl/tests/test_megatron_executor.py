"""The reshard executor over gloo: Megatron-Core layouts, bitwise results, deadline aborts.

Three processes run the cheap cases; the cases that need six (TP 4 -> 2) are marked slow.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from megatron_workers import reshard_plan, run
from nccl_workers import Report
from refit_lab.faults import ProcessGang
from refit_lab.ray_cluster import free_port

DEADLINE_S = 3.0
RELEASE_SLACK_S = 1.0
Reports = dict[str, dict[int, Report]]


def fault(signal: str) -> Report:
    """TP 2 -> 1 whose second source rank kills or freezes itself before the reshard."""
    return {"src": {"tp": 2}, "dst": {"tp": 1}, "colocated": False, "deadline_s": DEADLINE_S,
            "victim": 1, "signal": signal}  # fmt: skip


NARROW: dict[str, Report] = {
    "tp2->1": {"src": {"tp": 2}, "dst": {"tp": 1}, "colocated": False},
    "tp1->2": {"src": {"tp": 1}, "dst": {"tp": 2}, "colocated": False},
    "pp2->1": {"src": {"pp": 2}, "dst": {"pp": 1}, "colocated": False},
    "synchronizer tp2->1": {"src": {"tp": 2}, "dst": {"tp": 1}, "colocated": False,
                            "synchronizer": True},
    "SIGKILL source": fault("SIGKILL"),  # last: the victim is gone afterwards
}  # fmt: skip
WIDE: dict[str, Report] = {
    "tp4->2": {"src": {"tp": 4}, "dst": {"tp": 2}, "colocated": False},
    "colocated tp4->2": {"src": {"tp": 4}, "dst": {"tp": 2}, "colocated": True},
    "colocated tp2 unchanged": {"src": {"tp": 2}, "dst": {"tp": 2}, "colocated": True,
                                "alias": True},
    "SIGSTOP source": fault("SIGSTOP"),
}  # fmt: skip
STEPS = NARROW | WIDE
RESHARDS = [name for name, step in STEPS.items() if "victim" not in step]


def run_steps(steps: dict[str, Report]) -> Reports:
    """Run ``steps`` on as many processes as the widest needs; step -> process -> report."""
    named = [{"name": name, "port": free_port(), **step} for name, step in steps.items()]
    worlds = [reshard_plan(step).world_size for step in named]
    victims = sum("victim" in step for step in named)
    with ProcessGang() as gang:
        for proc in range(max(worlds)):
            gang.spawn(run, gang.results, proc, named)
        collected = gang.collect(sum(worlds) - victims, timeout_s=200)
    by_step: Reports = defaultdict(dict)
    for report in collected:
        by_step[report["step"]][report["proc"]] = report
    return by_step


@pytest.fixture(scope="module")
def narrow() -> Reports:
    return run_steps(NARROW)


@pytest.fixture(scope="module")
def wide() -> Reports:
    return run_steps(WIDE)


def reports_of(request: pytest.FixtureRequest, step: str) -> dict[int, Report]:
    fixture = "narrow" if step in NARROW else "wide"
    reports: Reports = request.getfixturevalue(fixture)
    return reports[step]


def marked(names: list[str]) -> list[object]:
    return [pytest.param(n, marks=[pytest.mark.slow] if n in WIDE else []) for n in names]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", marked(RESHARDS))
def test_reshard_is_bitwise_equal_to_the_oracle(request: pytest.FixtureRequest, step: str) -> None:
    plan = reshard_plan(STEPS[step])
    got = reports_of(request, step)
    assert sorted(got) == list(range(plan.world_size))
    for proc, report in got.items():
        assert report["error"] is None, f"proc {proc}: {report}"
        assert report["wrong"] == [], f"proc {proc}"
    if STEPS[step].get("synchronizer"):
        assert {r["version"] for r in got.values()} == {2}
        return
    sent = sum(r["stats"]["sent_bytes"] for r in got.values())
    received = sum(r["stats"]["received_bytes"] for r in got.values())
    assert sent == received == plan.sent_bytes == plan.lower_bound_bytes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_matching_colocated_layouts_copy_nothing(request: pytest.FixtureRequest) -> None:
    for report in reports_of(request, "colocated tp2 unchanged").values():
        stats = report["stats"]
        assert stats["aliased_bytes"] > 0
        assert stats["sent_bytes"] == stats["received_bytes"] == stats["copied_bytes"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", marked(["SIGKILL source", "SIGSTOP source"]))
def test_a_dead_source_aborts_the_destination_by_the_deadline(
    request: pytest.FixtureRequest, step: str
) -> None:
    destination = reports_of(request, step)[2]
    assert destination["error"] == "RefitTimeoutError", destination
    assert destination["after_deadline_s"] <= RELEASE_SLACK_S
