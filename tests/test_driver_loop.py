"""examples/driver_loop.py's loop, over both rows, through every fault a fleet meets.

Three engine shards in Ray actors (``examples/custom_engine.py``'s engine: the collective row
through ``EngineEndpoint``, the sparse row through ``EngineRelay``), refitted every step by
``driver_loop.RefitLoop``, which acts only on each error's hint. Between steps the fleet meets:
a worker killed mid-refit (hung inside ``on_refit_begin``), a worker frozen inside its refit
hook past the deadline and thawed while the others refit, a controller killed mid-refit and a
new one started, a deadline shorter than the transfer, and two faults in a row (a worker
killed, then another frozen in the resync of the recovery). After every step:

- every open engine holds exactly the bits of the version it reports (a closed one serves
  nothing and is not asked for bits);
- versions never repeat or go backwards: no version is ever seen with two sets of bits, each
  engine's commits only go up, a new controller starts above every version any engine began;
- the loop needed no decision but the hint: every error it met was followed as its hint says,
  it stopped only on ``FIX`` (the short deadline, which says how long the transfer needed),
  and never ran out of attempts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from refit_core import DeadlineTooShortError, Recovery, RefitTimeoutError

pytest.importorskip("ray", reason="ray (dev group) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HARNESS = Path(__file__).resolve().parent / "driver_loop_harness"  # not tests/ (see its README)
for folder in (HARNESS.parents[1] / "examples", HARNESS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import custom_engine  # noqa: E402
import driver_loop_fleets as fleets  # noqa: E402
import sparse_custom_engine  # noqa: E402
from driver_loop_scenario import SHORT_DEADLINE_S, Scenario  # noqa: E402


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    from refit_lab.ray_cluster import local_ray

    modules = [custom_engine, sparse_custom_engine, fleets]
    with local_ray(num_cpus=4, by_value=modules, object_store_memory=80 << 20, log_to_driver=False):
        yield


def run_every_fault(scenario: Scenario) -> None:
    """The scripted run: each fault once, in this order."""
    scenario.step(0)
    scenario.step(1)
    killer = scenario.kill_in_begin(2)
    scenario.step(2)
    killer.join(60)
    scenario.fleet.restart(2)
    scenario.step(3)  # the restarted shard answers: the loop takes it back in
    scenario.step(4, lambda: scenario.freeze_at_next_write(1))
    scenario.step(5, lambda: scenario.thaw_soon(1))
    scenario.crash_controller()
    scenario.step(6)
    short = scenario.short_deadline(7)
    assert short.needed_s is not None and short.needed_s > SHORT_DEADLINE_S, short.needed_s

    scenario.step(8, lambda: scenario.two_faults(killed=0, frozen=2))
    assert 2 in scenario.pids, "the recovery did not begin"
    scenario.fleet.restart(0)
    scenario.step(9, lambda: scenario.thaw_soon(2))
    scenario.step(10)
    scenario.step(11)


@pytest.mark.parametrize("row", fleets.ROWS)
def test_the_driver_loop_goes_on_by_itself_through_every_fault(ray_session: None, row: str) -> None:
    scenario = Scenario(row)
    try:
        run_every_fault(scenario)
        final = scenario.fleet.held(scenario.fleet.running())
    finally:
        scenario.close()
    assert sorted(final) == [0, 1, 2], "every shard is back"
    assert not any(closed for _, closed, _ in final.values())
    (served,) = {version for version, _, _ in final.values()}
    assert {bits for _, _, bits in final.values()} == {scenario.bits[served]}
    hinted = [a for a in scenario.actions if a.recovery is not None]
    for action in hinted:
        expected = {Recovery.FIX: "stop", Recovery.RETRY: "retry"}.get(action.recovery)
        assert action.did == (expected or "recover"), action
    stops = [a for a in hinted if a.recovery is Recovery.FIX]
    assert [a.step for a in stops] == [7], "the loop stopped only on the short deadline"
    assert [type(e) for e in scenario.stops] == [DeadlineTooShortError]
    assert sum(RefitTimeoutError.__name__ in (a.error or "") for a in hinted) >= 3
