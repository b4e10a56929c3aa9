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

import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from refit_core import (
    DeadlineTooShortError,
    Recovery,
    RecoveryReport,
    RefitError,
    RefitTimeoutError,
)

pytest.importorskip("ray", reason="ray (dev group) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

for folder in (Path(__file__).resolve().parents[1] / "examples", Path(__file__).parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import custom_engine  # noqa: E402
import driver_loop  # noqa: E402
import driver_loop_fleets as fleets  # noqa: E402
import sparse_custom_engine  # noqa: E402

DEADLINE_S = 4.0
SHORT_DEADLINE_S = 0.6
SLOW_TENSOR_S = 0.25
"""The short-deadline step: four tensors yielded this late take about 1 s."""


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    from refit_lab.ray_cluster import local_ray

    modules = [custom_engine, sparse_custom_engine, fleets]
    with local_ray(num_cpus=4, by_value=modules, object_store_memory=80 << 20, log_to_driver=False):
        yield


def _when(what: str, condition: Callable[[], bool], within_s: float = 60.0) -> None:
    give_up = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


class Scenario:
    """One row's fleet, trainer and controller, and the record every check compares with."""

    def __init__(self, row: str) -> None:
        self.row = row
        self.fleet = fleets.Fleet(row)
        self.trainer = fleets.TestTrainer()
        self.initial = {s: d for s, (_, _, d) in self.fleet.held(self.fleet.running()).items()}
        self.bits: dict[int, str] = {}  # version -> the trainer's bits it was claimed for
        self.seen: dict[int, str] = {}  # version -> the bits an open engine held under it
        self.claimed = 0
        self.loops = [self._controller(DEADLINE_S)]
        self.stops: list[RefitError] = []
        self.pids: dict[int, int] = {}

    @property
    def loop(self) -> driver_loop.RefitLoop:
        """The controller running now (a crashed or stopped one is kept, not used)."""
        return self.loops[-1]

    @property
    def actions(self) -> list[driver_loop.Action]:
        """What every controller's loop did, in order."""
        return [action for loop in self.loops for action in loop.actions]

    # -- controllers ------------------------------------------------------------------

    def _controller(self, deadline_s: float) -> driver_loop.RefitLoop:
        """A new controller: its synchronizer starts above every version any engine began."""
        sync = fleets.synchronizer(self.row, self.trainer, self.fleet, deadline_s)
        sync.init_communicator()
        began = [v for s in self.fleet.running() for v in self.fleet.began(s)]
        assert sync.high_water_mark >= max(began, default=0), "a new controller reuses versions"
        self._claim(sync.high_water_mark)
        return driver_loop.RefitLoop(sync, rejoin_every_s=0.0)

    def _claim(self, high_water: int) -> None:
        """Versions claimed since the last look carry the trainer's current bits."""
        weights = fleets.digest(self.trainer.model.state_dict())
        for version in range(self.claimed + 1, high_water + 1):
            self.bits[version] = weights
        self.claimed = max(self.claimed, high_water)

    # -- steps ------------------------------------------------------------------------

    def step(self, step: int, fault: Callable[[], None] | None = None) -> None:
        """Train, inject ``fault`` just before the refit, refit through the loop, check."""
        before = (lambda _: fault()) if fault is not None else None
        try:
            driver_loop.drive(self.loop, self.trainer.step, range(step, step + 1), before)
        finally:
            self._claim(self.loop.sync.high_water_mark)
        self.check(step)

    def check(self, step: int) -> None:
        """Every open engine holds the bits of the version it reports; versions never repeat
        with other bits and never go backwards on an engine."""
        for shard, (version, closed, bits) in self.fleet.held(self.fleet.running()).items():
            commits = self.fleet.committed(shard)
            assert commits == sorted(set(commits)), f"step {step}: shard {shard} {commits}"
            if closed:
                continue
            expected = self.initial[shard] if version == 0 else self.bits.get(version)
            assert bits == expected, f"step {step}: shard {shard} serves other bits than {version}"
            if version:
                assert self.seen.setdefault(version, bits) == bits, f"version {version} reused"

    # -- faults -----------------------------------------------------------------------

    def kill_in_begin(self, shard: int) -> threading.Thread:
        """``shard`` hangs inside its next ``on_refit_begin`` and is killed there."""
        worker = self.fleet.workers[shard]
        import ray

        ray.get(worker.fault_in_next_write.remote("hang"), timeout=60)

        def kill() -> None:
            _when("the worker to hang", lambda: ray.get(worker.is_hanging.remote(), timeout=60))
            self.fleet.kill(shard)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        return killer

    def freeze_at_next_write(self, shard: int) -> None:
        self.pids[shard] = self.fleet.pid(shard)
        self.fleet.freeze(shard)

    def thaw_soon(self, shard: int) -> None:
        """Thaw ``shard`` 0.2 s from now: while the others refit."""
        pid = self.pids.pop(shard)
        threading.Timer(0.2, self.fleet.thaw, (shard, pid)).start()

    def crash_controller(self) -> None:
        """The controller dies mid-refit (a process of its own, SIGKILLed once an engine began
        its version); a new one takes over."""
        import ray

        context = ray.get_runtime_context()
        generation = (
            self.fleet.names
            if self.row == "collective"
            else dict(enumerate(self.fleet.relay_addresses()))
        )
        floor = max(v for s in self.fleet.running() for v in self.fleet.began(s))
        weights = {n: t.detach().clone() for n, t in self.trainer.model.state_dict().items()}
        args = (self.row, context.gcs_address, context.namespace, generation, weights, DEADLINE_S)
        child = multiprocessing.get_context("spawn").Process(
            target=fleets.crashing_controller, args=args, daemon=True
        )
        child.start()
        try:
            _when(
                "the crashing controller's refit to begin",
                lambda: any(
                    max(self.fleet.began(s), default=0) > floor for s in self.fleet.running()
                ),
                within_s=120.0,
            )
        finally:
            child.kill()
            child.join(30)
        assert child.exitcode == -signal.SIGKILL, "the controller ended before it was killed"
        self.loops.append(self._controller(DEADLINE_S))

    def short_deadline(self) -> DeadlineTooShortError:
        """A controller whose deadline is shorter than the transfer: the loop stops on FIX,
        and a person starts one with a deadline that fits."""
        self.loops.append(self._controller(SHORT_DEADLINE_S))
        self.trainer.delay_s = SLOW_TENSOR_S
        with pytest.raises(DeadlineTooShortError) as stopped:
            self.step(7)
        self.check(7)
        self.trainer.delay_s = 0.0
        self.stops.append(stopped.value)
        self.loops.append(self._controller(DEADLINE_S))
        return stopped.value

    # -- the whole run ----------------------------------------------------------------

    def run(self) -> None:
        self.step(0)
        self.step(1)
        killer = self.kill_in_begin(2)
        self.step(2)
        killer.join(60)
        self.fleet.restart(2)
        self.step(3)  # the restarted shard answers: the loop takes it back in
        self.step(4, lambda: self.freeze_at_next_write(1))
        self.step(5, lambda: self.thaw_soon(1))
        self.crash_controller()
        self.step(6)
        short = self.short_deadline()
        assert short.needed_s is not None and short.needed_s > SHORT_DEADLINE_S, short.needed_s

        def two_faults() -> None:
            """Shard 0 killed in the refit, and shard 2 frozen as the recovery begins (its
            next write: the recovery's resync, or the refit after it)."""
            self.kill_in_begin(0)
            recover = self.loop.sync.recover

            def freezing_recover() -> RecoveryReport:
                self.loop.sync.recover = recover  # type: ignore[method-assign]
                self.freeze_at_next_write(2)
                return recover()

            self.loop.sync.recover = freezing_recover  # type: ignore[method-assign]

        self.step(8, two_faults)
        assert 2 in self.pids, "the recovery did not begin"
        self.fleet.restart(0)
        self.step(9, lambda: self.thaw_soon(2))
        self.step(10)
        self.step(11)

    def close(self) -> None:
        for shard, pid in list(self.pids.items()):
            self.fleet.thaw(shard, pid)
        for loop in self.loops:
            loop.sync.shutdown()
        self.fleet.close()


@pytest.mark.parametrize("row", fleets.ROWS)
def test_the_driver_loop_goes_on_by_itself_through_every_fault(ray_session: None, row: str) -> None:
    scenario = Scenario(row)
    try:
        scenario.run()
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
