"""examples/custom_engine.py, run: a user-written engine refitted bit-exactly through the
collective row, a worker killed mid-refit, the structured error, recover() and refits again."""

from __future__ import annotations

import sys
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


@pytest.fixture(scope="module")
def outcome() -> Iterator[custom_engine.Outcome]:
    from refit_lab.ray_cluster import local_ray

    options = {"object_store_memory": 80 << 20, "log_to_driver": False}
    with local_ray(num_cpus=4, by_value=[custom_engine], **options):
        yield custom_engine.run(shards=3, steps=3, victim=1)


def served_while_closed(events: list[tuple[str, int]]) -> list[int]:
    """Indices of requests an engine answered between a begin and the commit (or an abort
    that left its weights as they were)."""
    closed, wrong = False, []
    for index, (event, _) in enumerate(events):
        if event in ("begin", "abort-partial"):
            closed = True
        elif event in ("commit", "abort"):
            closed = False
        elif event == "generate" and closed:
            wrong.append(index)
    return wrong


def test_every_refit_is_bit_exact_on_every_live_engine(outcome: custom_engine.Outcome) -> None:
    versions = [r.version for r in outcome.refits]
    assert versions == [1, 2, 3, 5, 6], "three refits, recover()'s resync (4 failed), one more"
    for refit in outcome.refits:
        expected = {0, 1, 2} if refit.version <= 3 else {0, 2}
        assert set(refit.engines) == expected
        for shard, weights in refit.engines.items():
            assert weights.keys() == refit.trainer.keys()
            for name, tensor in refit.trainer.items():
                assert torch.equal(weights[name], tensor), f"v{refit.version} shard {shard} {name}"
    first, last = outcome.refits[0].trainer, outcome.refits[-1].trainer
    assert any(not torch.equal(first[n], last[n]) for n in first), "training moved the weights"


def test_the_killed_worker_is_named_and_the_failure_released(
    outcome: custom_engine.Outcome,
) -> None:
    error = outcome.error
    assert isinstance(error, RefitError) and error.recovery is Recovery.RECOVER
    assert str(error).startswith("refit to version 4 failed on shard 1 worker 0: ")
    assert 1 in error.failed_shards
    assert error.states() == {
        "shard 0 worker 0": EngineState.CLOSED,
        "shard 1 worker 0": EngineState.UNKNOWN,
        "shard 2 worker 0": EngineState.CLOSED,
    }
    assert isinstance(error, RefitTimeoutError), "a lost peer is always a timeout"
    assert error.wedged_workers == (), "the survivors answered: closed, not wedged"
    # released, not hung: well inside the 30 s refit deadline plus its grace
    assert outcome.released_after_s < 35.0
    assert outcome.refused_while_closed
    assert outcome.status.shards(EngineHealth.UNREACHABLE) == (1,)
    assert outcome.status.shards(EngineHealth.CLOSED) == (0, 2)


def test_recover_drops_the_dead_shard_and_the_rest_serve_one_version(
    outcome: custom_engine.Outcome,
) -> None:
    report = outcome.recovery
    assert report.dropped_shards == (1,)
    assert report.resync is not None and report.resync.version == 5
    assert report.after.serving() == {5: (0, 2)}
    assert report.after.shards(EngineHealth.UNREACHABLE) == (1,)


def test_no_engine_answered_while_closed(outcome: custom_engine.Outcome) -> None:
    assert set(outcome.events) == {0, 2}
    expected = [(hook, v) for v in (1, 2, 3) for hook in ("begin", "commit")]
    # The failed refit to 4 closed the engine and told it so (its own receive failed, or it
    # had received all of 4 when the refit failed elsewhere); the resync of recover()
    # (version 5: 4 is never used again) loaded into the closed engine and reopened it.
    expected += [("begin", 4), ("abort-partial", 4), ("commit", 5), ("begin", 6), ("commit", 6)]
    for shard, events in outcome.events.items():
        hooks = [e for e in events if e[0] != "generate"]
        assert hooks == expected, f"shard {shard}: {hooks}"
        assert served_while_closed(events) == [], f"shard {shard} answered while closed"
    assert outcome.traffic.answered > 0
