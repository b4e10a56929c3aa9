"""Chaos: seven relay processes in one tree (each started by the launcher, ``refit relay
serve``), refits by the zmq_sparse synchronizer under random SIGKILL, SIGSTOP/SIGCONT and
replacement of relays, the controller recovering after each as a framework would.

After every refit each live relay that holds no open transfer must hold exactly the bits of
the version it reports (all old or all new, never mixed); a relay still holding one is looked
at again once its deadline passed; one frozen relay is taken out of the tree at its SIGCONT
and looked at again 30 s later. Every failed refit must raise by its deadline + 1 s, with
every relay's state, and the refit after a fault must commit. ``pytest --run-long`` adds a
15-minute run with replacements that asserts the coordinator still answers throughout.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from relay_helpers import TUNING, LaunchedRelay, State, digests, start_launched, step_state

from refit_core import RefitError, TensorSpec, WeightVersion
from refit_core.backend import Deadline
from refit_core.sources import StateDictSource
from refit_zmq.relay import RelayCoordinator, RelayStatus
from refit_zmq.relay.launch import parse_shapes, random_state
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer, shard_producers
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

logger = logging.getLogger(__name__)

RELAYS = 7
TRANSFERS = 50
REFIT_TIMEOUT_S = 4.0
RELAY_TIMEOUT_S = 6.0
LATE_CHECK_S = 30.0
SPEC = "embed.weight=128x128:bfloat16,layers.0.mlp.weight=256x128:bfloat16,norm=128:float32"
OPTIONS = ZmqSparseOptions(
    shard_count=2,
    bucket_size_bytes=32 * 1024,
    call_timeout_s=5.0,
    tuning=dataclasses.replace(TUNING, heartbeat_timeout_s=5.0),
)


def _state(seed: int) -> State:
    """The random state a relay launched with ``seed`` starts from (the launcher's own)."""
    return random_state(parse_shapes(SPEC), seed)


def _launch(seed: int) -> LaunchedRelay:
    return start_launched(
        [
            *("serve", "--shapes", SPEC, "--seed", str(seed)),
            *("--timeout-s", str(RELAY_TIMEOUT_S), "--chunk-bytes", str(TUNING.chunk_bytes)),
            *("--max-inflight-bytes", str(TUNING.max_inflight_bytes)),
        ]
    )


def _warm_codec() -> None:
    """Load the codec's compiled kernels once, as a long-running trainer has them: the first
    delta a process encodes pays for that (seconds), which is not what this test measures."""
    state = _state(0)
    tracker = DeltaCompressionTracker(
        {name: TensorSpec.of(tensor) for name, tensor in state.items()}, TrackerConfig()
    )
    try:
        tracker.load_baseline(state, WeightVersion(1))
        for _ in tracker.encode(step_state(state, seed=1), WeightVersion(2)):
            pass
        tracker.abort()
    finally:
        tracker.close()


class _Weights:
    """The trainer: a state that moves one step per refit (a ``PolicyLike``)."""

    def __init__(self) -> None:
        self.state = _state(0)
        self._steps = 0

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)

    def step(self) -> None:
        self._steps += 1
        self.state = step_state(self.state, seed=5000 + self._steps)


@dataclasses.dataclass
class Tally:
    """What the run did and saw."""

    transfers: int = 0
    committed: int = 0
    failed: int = 0
    kills: int = 0
    stops: int = 0
    replacements: int = 0
    recoveries: int = 0
    checks: int = 0
    mixed: int = 0
    late_checks: int = 0
    max_over_deadline_s: float = float("-inf")


class Chaos:
    """The relays, the trainer, the synchronizer, and the bits each relay must hold."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tally = Tally()
        self.relays: list[LaunchedRelay] = []
        self.retired: list[LaunchedRelay] = []
        self.expected: dict[tuple[str, int | None], dict[str, int]] = {}
        for _ in range(RELAYS):
            self.relays.append(self._fresh())
        _warm_codec()
        self.weights = _Weights()
        self.sync = ZmqSparseWeightSynchronizer(
            shard_producers(self.weights, OPTIONS.shard_count),
            lambda: [relay.address for relay in self.relays],
            refit_timeout_s=REFIT_TIMEOUT_S,
            options=OPTIONS,
        )
        self.probe = RelayCoordinator(api_key=None, timeout_s=5.0, tuning=TUNING)
        self.rechecks: list[tuple[LaunchedRelay, float, bool]] = []
        self.resume: tuple[LaunchedRelay, float] | None = None
        self.refit_s = 0.2  # how long a refit without a fault takes here (a running mean)

    def _fresh(self) -> LaunchedRelay:
        seed = len(self.relays) + len(self.retired) + 1000
        relay = _launch(seed)
        self.expected[(relay.address, 0)] = digests(_state(seed))
        return relay

    def replace(self, index: int) -> LaunchedRelay:
        """A new relay process in slot ``index`` (another address, other bits, version 0);
        the old one, returned."""
        old = self.relays[index]
        self.relays[index] = self._fresh()
        self.tally.replacements += 1
        return old

    # -- what every relay must hold -------------------------------------------------------

    def check(self, relay: LaunchedRelay, *, final: bool) -> bool:
        """Whether ``relay`` holds exactly the bits of its version (False, to look again
        later, while it holds an open transfer, unless ``final``)."""
        (status,) = self.probe.status(
            digests=True, relays=[relay.address], deadline=Deadline.never()
        ).values()
        assert isinstance(status, RelayStatus), f"live relay {relay.address} silent: {status}"
        if status.open_transfers:
            assert not final, f"{relay.address} still holds {sorted(status.open_transfers)}"
            return False
        self.tally.checks += 1
        bits = self.expected.get((relay.address, status.version))
        if bits is None:
            bits = self.expected.get(("trainer", status.version))
        if status.digests != bits:
            self.tally.mixed += 1
            logger.error("MIXED: relay %s at version %s", relay.address, status.version)
        return True

    def check_live(self) -> None:
        due = time.monotonic() + REFIT_TIMEOUT_S + 1.0
        for relay in self.relays:
            if relay.alive and not relay.stopped and not self.check(relay, final=False):
                self.rechecks.append((relay, due, False))

    def due_rechecks(self, *, wait: bool = False) -> None:
        for item in sorted(self.rechecks, key=lambda entry: entry[1]):
            relay, due, late = item
            if wait:
                time.sleep(max(0.0, due - time.monotonic()))
            elif time.monotonic() < due:
                continue
            self.rechecks.remove(item)
            if relay.alive and not relay.stopped:
                self.check(relay, final=True)
                self.tally.late_checks += late

    # -- faults and recovery -------------------------------------------------------------

    def refit(self, fault: Callable[[], None] | None = None) -> bool:
        """One refit with ``fault`` fired from another thread meanwhile; whether it
        committed (a failure must come by the deadline + 1 s, with every relay's state)."""
        self.weights.step()
        firing = None if fault is None else threading.Thread(target=fault)
        self.tally.transfers += 1
        started = time.monotonic()
        if firing is not None:
            firing.start()
        failure: RefitError | None = None
        try:
            result = self.sync.sync_weights()
        except RefitError as error:
            failure = error
        elapsed = time.monotonic() - started
        if firing is not None:
            firing.join()
        if failure is not None:
            self.tally.failed += 1
            over = elapsed - REFIT_TIMEOUT_S
            self.tally.max_over_deadline_s = max(self.tally.max_over_deadline_s, over)
            assert elapsed <= REFIT_TIMEOUT_S + 1.0, f"failed after {elapsed:.2f} s: {failure}"
            assert failure.engines and len(str(failure).splitlines()) == 1, repr(failure)
            logger.info("refit %d failed: %s", self.tally.transfers, failure)
            return False
        self.expected[("trainer", result.version)] = digests(self.weights.state)
        self.tally.committed += 1
        if fault is None:
            self.refit_s = 0.8 * self.refit_s + 0.2 * elapsed
        return True

    def _during(self, relay: LaunchedRelay, signum: signal.Signals) -> Callable[[], None]:
        """``signum`` to ``relay`` at a random moment of the refit (as long as refits have
        taken here, so that it lands in any phase: probe, stream, flush, decision)."""
        delay = self.rng.uniform(0.0, self.refit_s)

        def fire() -> None:
            time.sleep(delay)
            relay.signal(signum)

        return fire

    def kill_during(self, index: int) -> Callable[[], None]:
        self.tally.kills += 1
        return self._during(self.relays[index], signal.SIGKILL)

    def stop_during(self, index: int) -> Callable[[], None]:
        """SIGSTOP during the refit; SIGCONT 0.5 s to 2.5 deadlines after the refit began
        (before or after the frozen relay's own deadline)."""
        relay = self.relays[index]
        self.resume = (relay, time.monotonic() + self.rng.uniform(0.5, 2.5 * REFIT_TIMEOUT_S))
        self.tally.stops += 1
        return self._during(relay, signal.SIGSTOP)

    def recover(self, *, quarantine: bool) -> None:
        """What a framework does after a fault: resume the frozen relay (or take it out of
        the tree and watch it for 30 s), replace the dead ones, then ``recover()``, which
        must leave every relay serving one version."""
        if self.resume is not None:
            relay, when = self.resume
            self.resume = None
            time.sleep(max(0.0, when - time.monotonic()))
            relay.signal(signal.SIGCONT)
            if quarantine and relay in self.relays:
                self.replace(self.relays.index(relay))
                self.rechecks.append((relay, time.monotonic() + LATE_CHECK_S, True))
                self.retired.append(relay)
        for index, relay in enumerate(self.relays):
            if not relay.alive:
                self.retired.append(self.replace(index))
        report = self.sync.recover()
        assert report.after.consistent, f"recover() left {report.after.describe()}"
        if report.resync is not None:
            self.expected[("trainer", report.resync.version)] = digests(self.weights.state)
        self.tally.recoveries += 1

    def close(self) -> None:
        self.sync.shutdown()
        self.probe.close()
        for relay in [*self.relays, *self.retired]:
            relay.close()


@pytest.fixture
def chaos() -> Iterator[Chaos]:
    created = Chaos(random.Random(20261201))
    try:
        yield created
    finally:
        created.close()


def _run(chaos: Chaos, *, transfers: int | None = None, seconds: float | None = None) -> None:
    rng = chaos.rng
    assert chaos.refit(), "the first refit (a dense resync) commits"
    chaos.check_live()
    started = time.monotonic()
    quarantined = False
    while (transfers is None or chaos.tally.transfers < transfers) and (
        seconds is None or time.monotonic() - started < seconds
    ):
        chaos.due_rechecks()
        index, roll = rng.randrange(RELAYS), rng.random()
        if roll < 0.6:
            stop = roll >= 0.3
            fault = chaos.stop_during(index) if stop else chaos.kill_during(index)
            chaos.refit(fault)
            chaos.check_live()
            chaos.recover(quarantine=stop and not quarantined)
            quarantined |= stop
        elif roll < 0.75:  # a relay replaced between refits (a restarted worker)
            chaos.retired.append(chaos.replace(index))
            chaos.retired[-1].close()
            chaos.sync.reconcile_communicator(())
        assert chaos.refit(), "the refit after a fault, or without one, commits"
        chaos.check_live()
        answered = chaos.probe.status(
            relays=[r.address for r in chaos.relays], deadline=Deadline.never()
        )
        assert all(isinstance(s, RelayStatus) for s in answered.values()), answered
    chaos.due_rechecks(wait=True)


def _report(chaos: Chaos) -> None:
    logger.warning("chaos: %s", chaos.tally)
    print(f"chaos: {chaos.tally}")
    assert chaos.tally.mixed == 0, f"{chaos.tally.mixed} checks found mixed bits"


@pytest.mark.slow  # runs once in CI (the workspace run), not again in the isolated one
@pytest.mark.timeout(900)
def test_refits_under_kills_freezes_and_replacements_are_never_mixed(chaos: Chaos) -> None:
    _run(chaos, transfers=TRANSFERS)
    _report(chaos)
    tally = chaos.tally
    assert tally.kills and tally.stops and tally.replacements and tally.late_checks >= 1


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_fifteen_minutes_of_chaos_and_the_coordinator_still_answers(chaos: Chaos) -> None:
    _run(chaos, seconds=15 * 60)
    _report(chaos)
