"""The driver-loop tests' scenario: one row's fleet, trainer and controllers, the faults a
test injects between steps, and the checks after every step (see ``test_driver_loop.py``)."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections.abc import Callable

import driver_loop
import driver_loop_fleets as fleets
from refit_core import DeadlineTooShortError, RecoveryReport, RefitError

DEADLINE_S = 4.0
SHORT_DEADLINE_S = 0.6
SLOW_TENSOR_S = 0.25
"""The short-deadline step: four tensors yielded this late take about 1 s."""


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

    def short_deadline(self, step: int) -> DeadlineTooShortError:
        """A controller whose deadline is shorter than the transfer: the loop stops on FIX,
        and a person starts one with a deadline that fits."""
        self.loops.append(self._controller(SHORT_DEADLINE_S))
        self.trainer.delay_s = SLOW_TENSOR_S
        try:
            self.step(step)
        except DeadlineTooShortError as stopped:
            self.stops.append(stopped)
        else:
            raise AssertionError("a deadline shorter than the transfer did not stop the loop")
        finally:
            self.trainer.delay_s = 0.0
        self.check(step)
        self.loops.append(self._controller(DEADLINE_S))
        return self.stops[-1]

    def two_faults(self, killed: int, frozen: int) -> None:
        """``killed`` killed in the refit, and ``frozen`` frozen as the recovery begins (its
        next write: the recovery's resync, or the refit after it)."""
        self.kill_in_begin(killed)
        recover = self.loop.sync.recover

        def freezing_recover() -> RecoveryReport:
            self.loop.sync.recover = recover  # type: ignore[method-assign]
            self.freeze_at_next_write(frozen)
            return recover()

        self.loop.sync.recover = freezing_recover  # type: ignore[method-assign]

    # -- the whole run ----------------------------------------------------------------

    def close(self) -> None:
        for shard, pid in list(self.pids.items()):
            self.fleet.thaw(shard, pid)
        for loop in self.loops:
            loop.sync.shutdown()
        self.fleet.close()
