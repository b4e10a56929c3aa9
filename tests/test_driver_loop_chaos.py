"""The chaos tier's driver loop: ``test_driver_loop.py``'s checks under random faults.

Both rows in turn, for ``REFIT_CHAOS_MINUTES`` in all (default 10, half each), the loop of
``examples/driver_loop.py`` refits three engine shards every step while, drawn from a seeded
generator (``REFIT_CHAOS_SEED``, so a failing run can be replayed), a worker is killed in
the middle of a refit, frozen inside its refit hook and thawed while the others refit a step
later, two faults come in a row, the controller is killed mid-refit and a new one started, or
a controller starts with a deadline shorter than the transfer. After every step: every open
engine holds exactly the bits of the version it reports, versions never repeat or go
backwards, and the loop followed nothing but the hints (it stops only on the short deadline's
``FIX``). Killed workers are replaced after their step; at the end every shard serves one
version, bit for bit the trainer's.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from refit_core import DeadlineTooShortError, Recovery

pytest.importorskip("ray", reason="ray (dev group) is not installed")

HARNESS = Path(__file__).resolve().parent / "driver_loop_harness"  # not tests/ (see its README)
for folder in (HARNESS.parents[1] / "examples", HARNESS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import custom_engine  # noqa: E402
import driver_loop_fleets as fleets  # noqa: E402
import sparse_custom_engine  # noqa: E402
from driver_loop_scenario import Scenario  # noqa: E402

MINUTES = float(os.environ.get("REFIT_CHAOS_MINUTES", "10"))
SEED = int(os.environ.get("REFIT_CHAOS_SEED", "2031"))
FAULTS = ("none", "none", "kill", "freeze", "two", "crash", "short")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    from refit_lab.ray_cluster import local_ray

    modules = [custom_engine, sparse_custom_engine, fleets]
    with local_ray(num_cpus=4, by_value=modules, object_store_memory=80 << 20, log_to_driver=False):
        yield


def _random_run(scenario: Scenario, rng: random.Random, until: float) -> dict[str, int]:
    """Steps with random faults until ``until`` (``time.monotonic()``); how often each came."""
    drawn = dict.fromkeys(FAULTS, 0)
    step = 0
    while time.monotonic() < until:
        for shard in list(scenario.pids):  # frozen in the last step: thawed while this refits
            scenario.step(step, partial(scenario.thaw_soon, shard))
            step += 1
        running = scenario.fleet.running()
        fault = rng.choice(FAULTS) if len(running) == 3 else "none"
        drawn[fault] += 1
        victim, other = rng.sample(range(3), 2)
        if fault == "kill":
            killer = scenario.kill_in_begin(victim)
            scenario.step(step)
            killer.join(60)
        elif fault == "freeze":
            scenario.step(step, partial(scenario.freeze_at_next_write, victim))
        elif fault == "two":
            scenario.step(step, partial(scenario.two_faults, killed=victim, frozen=other))
        elif fault == "crash":
            scenario.crash_controller()
            scenario.step(step)
        elif fault == "short":
            scenario.short_deadline(step)
        else:
            scenario.step(step)
        for dead in sorted(scenario.fleet.dead):
            scenario.fleet.restart(dead)
        step += 1
    for shard in list(scenario.pids):
        scenario.step(step, partial(scenario.thaw_soon, shard))
        step += 1
    scenario.step(step)
    scenario.step(step + 1)  # the last returned shards are taken back in after a good refit
    return drawn


@pytest.mark.chaos
@pytest.mark.timeout(int(MINUTES * 60) + 600)
@pytest.mark.parametrize("row", fleets.ROWS)
def test_the_driver_loop_under_random_faults(ray_session: None, row: str) -> None:
    rng = random.Random(f"{SEED}-{row}")
    scenario = Scenario(row)
    try:
        drawn = _random_run(scenario, rng, time.monotonic() + MINUTES * 60 / len(fleets.ROWS))
        final = scenario.fleet.held(scenario.fleet.running())
    finally:
        scenario.close()
    assert sorted(final) == [0, 1, 2], f"every shard is back ({drawn})"
    assert not any(closed for _, closed, _ in final.values())
    (served,) = {version for version, _, _ in final.values()}
    assert {bits for _, _, bits in final.values()} == {scenario.bits[served]}
    for action in scenario.actions:
        if action.recovery is not None:
            expected = {Recovery.FIX: "stop", Recovery.RETRY: "retry"}.get(action.recovery)
            assert action.did == (expected or "recover"), action
    stops = [a for a in scenario.actions if a.recovery is Recovery.FIX]
    assert len(stops) == drawn["short"] == len(scenario.stops), "stopped only on short deadlines"
    assert all(isinstance(e, DeadlineTooShortError) for e in scenario.stops)
    assert sum(drawn.values()) - drawn["none"] > 0, f"the seed drew no fault: {drawn}"
