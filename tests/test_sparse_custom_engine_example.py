"""examples/sparse_custom_engine.py, run: a user-written engine refitted bit-exactly over the
relay tree; a worker frozen (SIGSTOP) inside its own ``on_refit_begin`` past the deadline,
left out by recover(), thawed while the others refit: it rolls the transfer back and serves
exactly its old version, open (its engine told by on_refit_abort), until recover() takes it
back in. Also: a relay killed mid-refit is found at once, not at the deadline."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refit_core import EngineHealth, EngineState, Recovery, RefitError, RefitTimeoutError

pytest.importorskip("ray", reason="ray (dev group) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import custom_engine  # noqa: E402
import sparse_custom_engine as sparse  # noqa: E402


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    from refit_lab.ray_cluster import local_ray

    options = {"object_store_memory": 80 << 20, "log_to_driver": False}
    with local_ray(num_cpus=4, by_value=[custom_engine, sparse], **options):
        yield


@pytest.fixture(scope="module")
def outcome(ray_session: None) -> sparse.Outcome:
    return sparse.run(shards=3, steps=3, victim=1)


def _same(weights: custom_engine.Weights, other: custom_engine.Weights) -> bool:
    return weights.keys() == other.keys() and all(torch.equal(weights[n], other[n]) for n in other)


def test_every_refit_is_bit_exact_on_every_live_engine(outcome: sparse.Outcome) -> None:
    versions = [r.version for r in outcome.refits]
    assert versions == [1, 2, 3, 5, 6, 7], "4 failed on the frozen worker: never used again"
    for refit in outcome.refits:
        assert set(refit.engines) == ({0, 2} if refit.version == 5 else {0, 1, 2})
        for shard, weights in refit.engines.items():
            assert _same(weights, refit.trainer), f"v{refit.version} shard {shard}"


def test_the_frozen_worker_is_named_and_left_out_within_a_probe(outcome: sparse.Outcome) -> None:
    error = outcome.error
    assert isinstance(error, RefitTimeoutError) and error.recovery is Recovery.RECOVER
    assert 1 in error.failed_shards and error.states()[sparse_relay(outcome, 1)] is (
        EngineState.UNKNOWN
    )
    assert outcome.status.shards(EngineHealth.UNREACHABLE) == (1,)
    assert outcome.status.serving() == {3: (0, 2)}
    # released, not hung: one probe (1 s), not the 5 s deadline
    assert outcome.status_s < sparse.DEADLINE_S / 2
    assert outcome.recovery.dropped_shards == (1,) and outcome.recovery.resync is None
    assert outcome.recovery_s < sparse.DEADLINE_S
    assert outcome.recovery.after.left_out == (1,)


def test_the_thawed_worker_serves_exactly_its_old_version_open(outcome: sparse.Outcome) -> None:
    """Frozen inside on_refit_begin(4), thawed while the others refitted version 5: the relay
    rolled transfer 4 back on its own and told the engine, which serves version 3, bit for
    bit, and is open (no request is held for ever)."""
    assert outcome.thawed_version == 3 and not outcome.thawed_closed
    assert _same(outcome.thawed_weights, outcome.refits[2].trainer)
    hooks = outcome.events[outcome.frozen_shard]
    assert hooks[hooks.index(("begin", 4)) :][:2] == [("begin", 4), ("abort", 4)]
    assert outcome.returned.returned == (1,)
    assert outcome.returned.serving() == {3: (1,), 5: (0, 2)}
    assert outcome.returned.high_water_mark == 5


def test_recover_takes_the_returned_worker_back_in(outcome: sparse.Outcome) -> None:
    report = outcome.rejoined
    assert report.dropped_shards == () and report.resync is not None
    assert report.resync.version == 6 and report.after.serving() == {6: (0, 1, 2)}
    assert report.after.left_out == ()
    for shard, hooks in outcome.events.items():
        begun = [v for hook, v in hooks if hook == "begin"]
        ended = [v for hook, v in hooks if hook in ("commit", "abort")]
        assert begun == ended, f"shard {shard}: every begin ends in a commit or an abort"


def sparse_relay(outcome: sparse.Outcome, shard: int) -> str:
    """The label (relay address) of ``shard``'s engine in the error."""
    return next(e.worker for e in outcome.error.engines if e.shard == shard)


def test_a_relay_killed_mid_refit_is_found_at_once(ray_session: None) -> None:
    """A worker hangs inside on_refit_begin and is killed: its relay's port refuses
    connections, so the refit fails at once (not at the deadline), naming its shard."""
    import ray

    fleet, trainer = sparse.RelayFleet(3), custom_engine.Trainer()
    sync = sparse.make_synchronizer(trainer, fleet)
    victim = fleet.workers[2]
    try:
        sync.sync_weights()
        ray.get(victim.fault_in_next_write.remote("hang"), timeout=60)
        killed: list[float] = []

        def kill() -> None:
            custom_engine.wait_for("the hang", lambda: ray.get(victim.is_hanging.remote()))
            killed.append(time.monotonic())
            ray.kill(victim, no_restart=True)

        killer = threading.Thread(target=kill)
        killer.start()
        trainer.step()
        with pytest.raises(RefitError) as failed:
            sync.sync_weights()
        released = time.monotonic()
        killer.join(60)
        assert released - killed[0] < sparse.DEADLINE_S / 2, "found at once, not at the deadline"
        error = failed.value
        assert isinstance(error, RefitTimeoutError) and error.recovery is Recovery.RECOVER
        assert error.states()[fleet.relay_addresses()[2]] is EngineState.UNKNOWN
        assert 2 in error.failed_shards and "refuses connections" in str(error)
    finally:
        sync.shutdown()
        fleet.close()
