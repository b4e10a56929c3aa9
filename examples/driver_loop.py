"""A framework's refit loop that needs no human: refit, read the hint, recover, go on.

Every ``RefitError`` says what makes the next refit succeed (``error.recovery``). The loop
below trusts only that:

- ``RETRY``: refit again as is;
- ``RECOVER`` / ``RESYNC``: ``sync.recover()`` (drops the engines that do not answer, takes
  back those that answer again, resyncs the closed and the disagreeing), then refit again;
- ``FIX``: stop. A person must change something (a deadline shorter than the transfer
  says how long it needed: ``DeadlineTooShortError.needed_s``; a wrong geometry or key).

``recover()`` can fail too (a second fault during its resync): its error carries a hint of
its own, read the same way. An engine left out by ``recover()`` (it did not answer) that
answers again shows in ``sync.status().returned``; the loop looks for it after a good refit
(at most every ``rejoin_every_s``) and lets ``recover()`` take it back in. Nothing else is
decided here: every action is the hint's.

``main()`` runs it over ``examples/custom_engine.py``'s engines on the collective row: a worker
hangs inside its ``on_refit_begin`` and is killed, later a replacement starts; the loop goes
on by itself and prints what it did. Run it: ``uv run python examples/driver_loop.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from custom_engine import EngineFleet, EngineWorker, Trainer, make_synchronizer, wait_for
from refit_core import (
    Recovery,
    RecoveryReport,
    RefitError,
    RefitResult,
    WeightSynchronizer,
)
from refit_lab.ray_cluster import local_ray

__all__ = ["Action", "NoProgressError", "RefitLoop", "drive"]


# --8<-- [start:loop]
@dataclass(frozen=True)
class Action:
    """One thing the loop did: the error it met (or None) and what the hint made it do."""

    step: int
    error: str | None
    recovery: Recovery | None
    did: str


class NoProgressError(RuntimeError):
    """Refits kept failing ``max_attempts`` times in a row although no hint said stop: a
    bug to report (the hints promise progress), never a state to loop in."""


@dataclass
class RefitLoop:
    """Refits through ``sync`` as the hints say (see the module docstring).

    Args:
        sync: the synchronizer (a new one after a controller restart).
        max_attempts: refits (and recoveries) one step may take before giving up.
        rejoin_every_s: how often, at most, to look for left-out engines that answer again.
    """

    sync: WeightSynchronizer
    max_attempts: int = 8
    rejoin_every_s: float = 10.0
    actions: list[Action] = field(default_factory=list)
    _left_out: tuple[int, ...] = ()
    _looked_at: float = 0.0

    def refit(self, step: int) -> RefitResult:
        """One refit of the trainer's current weights, through whatever the hints ask.

        Raises:
            RefitError: an error whose hint is ``FIX`` (the loop stops there).
            NoProgressError: ``max_attempts`` failures in a row.
        """
        for _ in range(self.max_attempts):
            try:
                result = self.sync.sync_weights()
            except RefitError as error:
                resynced = self._follow(step, error)
                if resynced is None:
                    continue
                result = resynced  # recover() moved this step's weights already
            else:
                self.actions.append(Action(step, None, None, f"refit to {result.version}"))
            self._take_back_returned(step)
            return result
        raise NoProgressError(f"step {step}: {self.max_attempts} refits failed in a row")

    def _follow(self, step: int, error: RefitError) -> RefitResult | None:
        """Do what ``error.recovery`` says; the resync of a recovery (None: refit again).

        Raises:
            RefitError: ``error``, when its hint is ``FIX``.
        """
        what = f"{type(error).__name__}: {str(error)[:120]}"
        if error.recovery is Recovery.FIX:
            self.actions.append(Action(step, what, error.recovery, "stop"))
            raise error
        if error.recovery is Recovery.RETRY:
            self.actions.append(Action(step, what, error.recovery, "retry"))
            return None
        self.actions.append(Action(step, what, error.recovery, "recover"))
        return self._recover(step)

    def _recover(self, step: int) -> RefitResult | None:
        """``recover()``, again as long as its own errors ask for it; its resync, if any."""
        for _ in range(self.max_attempts):
            try:
                report = self.sync.recover()
            except RefitError as error:  # a fault during the recovery: its own hint
                what = f"{type(error).__name__}: {str(error)[:120]}"
                if error.recovery is Recovery.FIX:
                    self.actions.append(Action(step, what, error.recovery, "stop"))
                    raise
                self.actions.append(Action(step, what, error.recovery, "recover"))
                continue
            return self._recovered(step, report)
        raise NoProgressError(f"step {step}: {self.max_attempts} recoveries failed in a row")

    def _recovered(self, step: int, report: RecoveryReport) -> RefitResult | None:
        self._left_out = report.after.left_out
        resync = None if report.resync is None else report.resync.version
        self.actions.append(
            Action(step, None, None, f"recovered: dropped {report.dropped_shards}, resync {resync}")
        )
        return report.resync

    def _take_back_returned(self, step: int) -> None:
        """Recover when an engine left out answers again (looked for at most every
        ``rejoin_every_s``, and only while one is left out)."""
        now = time.monotonic()
        if not self._left_out or now - self._looked_at < self.rejoin_every_s:
            return
        self._looked_at = now
        status = self.sync.status()
        self._left_out = status.left_out
        if status.returned:
            self.actions.append(Action(step, None, None, f"shards {status.returned} returned"))
            self._recover(step)


def drive(
    loop: RefitLoop,
    train_step: Callable[[], None],
    steps: range,
    before_refit: Callable[[int], None] | None = None,
) -> list[RefitResult]:
    """The framework's loop: train, refit (through the hints), for each step of ``steps``;
    ``before_refit(step)`` runs just before each refit (where a test injects faults)."""
    results = []
    for step in steps:
        train_step()
        if before_refit is not None:
            before_refit(step)
        results.append(loop.refit(step))
    return results


# --8<-- [end:loop]


def run(steps: int = 6) -> list[Action]:
    """Refit ``examples/custom_engine.py``'s three engines ``steps`` times; in step 2 shard 1
    hangs inside ``on_refit_begin`` and is killed, in step 4 a replacement starts. Needs a
    running Ray cluster."""
    fleet, trainer = EngineFleet(3), Trainer()
    loop = RefitLoop(make_synchronizer(trainer, fleet), rejoin_every_s=0.0)

    def kill_when_hanging(victim: Any) -> None:
        wait_for("the worker to hang", lambda: ray.get(victim.is_hanging.remote(), timeout=60))
        ray.kill(victim, no_restart=True)

    def faults(step: int) -> None:
        if step == 2:
            victim = fleet.workers[1]
            ray.get(victim.fault_in_next_write.remote("hang"), timeout=60)
            threading.Thread(target=kill_when_hanging, args=(victim,), daemon=True).start()
        if step == 4:
            actor = ray.remote(EngineWorker).options(max_concurrency=4, num_cpus=0)
            fleet.workers[1] = actor.remote(seed=101)

    try:
        drive(loop, trainer.step, range(steps), faults)
    finally:
        loop.sync.shutdown()
        fleet.close()
    return loop.actions


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    with local_ray(num_cpus=4, log_to_driver=False):
        actions = run()
    for action in actions:
        hint = "" if action.recovery is None else f" [{action.recovery.value}]"
        print(
            f"step {action.step}: {action.did}{hint}"
            + (f"  <- {action.error}" if action.error else "")
        )


if __name__ == "__main__":
    main()
