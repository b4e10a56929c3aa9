"""A relay frozen after it prepared misses the COMMIT: the refit still returns (the commit was
decided), names the engine in ``engines_to_switch``, and ``wait_for_switch`` waits until the
relay, running again, serves the version."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from relay_helpers import TUNING, RelayFleet, RelaySpec, Trainer, digests, make_state

from refit_core import RefitTimeoutError
from refit_core.backend import Deadline
from refit_zmq.relay import RelayCoordinator, RelayStatus
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer

pytestmark = pytest.mark.timeout(180)


def _freeze(pid: int, within_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (a signal is delivered
    when a thread next runs: under load, a relay thread could otherwise answer first)."""
    os.kill(pid, signal.SIGSTOP)
    give_up = time.monotonic() + within_s
    tasks = Path(f"/proc/{pid}/task")
    while any(
        (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t")
        for task in tasks.iterdir()
    ):
        assert time.monotonic() < give_up, f"relay {pid} did not stop"
        time.sleep(0.01)


@pytest.fixture
def fleet() -> Iterator[RelayFleet]:
    with RelayFleet([RelaySpec(seed=5, timeout_s=4.0), RelaySpec(seed=5, timeout_s=4.0)]) as made:
        yield made


def test_an_engine_that_missed_the_commit_is_named_and_waited_for(fleet: RelayFleet) -> None:
    trainer = Trainer(make_state(5), version=0)
    sync = ZmqSparseWeightSynchronizer(
        trainer.participants,
        lambda: fleet.addresses,
        refit_timeout_s=4.0,
        options=ZmqSparseOptions(call_timeout_s=1.0, tuning=TUNING),
        on_commit=lambda version: None,  # the relays' receivers write in place: nothing to load
    )
    frozen = fleet.addresses[1]
    try:
        assert sync.sync_weights().engines_to_switch == ()
        trainer.step(seed=6)
        staged = sync.stage_weights()  # prepared on both relays
        _freeze(fleet.pids[1])
        try:
            result = sync.commit_weights(staged)  # returns: the commit was decided
            assert result.engines_to_switch == (frozen,)
            assert not result.ok
            with pytest.raises(RefitTimeoutError, match=f"engines \\['{frozen}'\\] do not serve"):
                sync.wait_for_switch(result, timeout_s=1.0)
        finally:
            os.kill(fleet.pids[1], signal.SIGCONT)
        fleet_status = sync.wait_for_switch(result, timeout_s=60.0)
        assert fleet_status.agreed_version == result.version == 2
        probe = RelayCoordinator(api_key=None, timeout_s=5.0, tuning=TUNING)
        try:
            statuses = probe.status(
                relays=fleet.addresses, digests=True, deadline=Deadline.after(30.0)
            )
        finally:
            probe.close()
        held = {a: s.digests for a, s in statuses.items() if isinstance(s, RelayStatus)}
        assert held == {a: digests(trainer.state) for a in fleet.addresses}
    finally:
        sync.shutdown()
        trainer.close()
