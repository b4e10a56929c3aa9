"""Refit while serving over the collective row: stage beside every engine, commit in one pause.

Two reference-engine shards run as Ray actors in a real gloo group; each engine logs its
refit hooks with the tokens it had generated when each was called.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import pytest

from refit_core import EngineHealth, EngineState, Recovery, RefitError
from refit_lab.conformance import trainer_generation
from refit_lab.digest import state_digest
from refit_lab.faults import kill
from refit_lab.reference_engine import (
    GenerationOutput,
    ReferenceEngine,
    WeightVersionSpan,
    random_checkpoint,
)
from refit_lab.trainer import SimulatedTrainer
from refit_nccl import CollectiveWeightSynchronizer

pytest.importorskip("ray", reason="ray (dev group) is not installed")

from ray_fleet import CONFIG, PROMPTS, failing_in_thread, make_synchronizer, wait_for

logger = logging.getLogger(__name__)


def expected_digests(trainer: SimulatedTrainer) -> dict[str, int]:
    return state_digest(trainer.engine_state().items())


def fresh(fleet: Any, seed: int) -> tuple[SimulatedTrainer, CollectiveWeightSynchronizer]:
    """The fleet back on its initial engines, a trainer from ``seed`` and a synchronizer."""
    fleet.reset(seed=100)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, seed), lr=1e-2)
    return trainer, make_synchronizer(trainer, fleet, timeout_s=30.0)


def restore(fleet: Any, index: int, worker: Any, pid: int, seed: int) -> None:
    """Leave a whole fleet behind a test that killed shard ``index``'s worker ``pid``."""
    kill(pid)
    if fleet.workers[index] is worker:
        fleet.restart(index, seed=seed)


@pytest.mark.timeout(300)
def test_stage_then_commit_is_bit_exact_and_hooks_run_only_at_the_commit(fleet: Any) -> None:
    """Staging moves the whole version beside every engine (status shows it staged) without
    touching what they serve or calling a hook; the commit serves it bit-exact everywhere,
    each engine hearing begin then commit, in one pause shorter than the whole refit."""
    trainer, synchronizer = fresh(fleet, 3)
    try:
        before = fleet.call("state_digests")
        old_tokens = fleet.call("generate", PROMPTS, 5)
        staged = synchronizer.stage_weights()
        assert staged.version == 1 and synchronizer.staged == staged
        assert fleet.call("state_digests") == before
        assert fleet.call("weight_version") == [0, 0]
        assert fleet.call("hooks") == [[], []]
        assert fleet.call("generate", PROMPTS, 5) == old_tokens
        status = synchronizer.status()
        assert [e.version for e in status.engines] == [0, 0]
        assert [e.staged_version for e in status.engines] == [1, 1]

        result = synchronizer.commit_weights(staged)
        assert result.version == synchronizer.version == 1 and result.ok
        assert fleet.call("state_digests") == [expected_digests(trainer)] * 2
        assert fleet.call("weight_version") == [1, 1]
        assert [[h[:2] for h in hooks] for hooks in fleet.call("hooks")] == [
            [("begin", 1), ("commit", 1)]
        ] * 2
        assert (
            fleet.call("generate", PROMPTS, 5)
            == [trainer_generation(trainer, CONFIG, PROMPTS, 5)] * 2
        )
        assert synchronizer.staged is None
        assert [e.staged_version for e in synchronizer.status().engines] == [None, None]
        pause_s, transfer_s = result.timings_s["pause"], result.timings_s["transfer"]
        assert 0 < pause_s < result.total_s
        logger.info(
            "pause %.4f s, transfer %.4f s, refit %.4f s", pause_s, transfer_s, result.total_s
        )
    finally:
        synchronizer.shutdown()


@pytest.mark.timeout(300)
def test_stage_then_abort_leaves_the_old_bits_and_calls_no_hook(fleet: Any) -> None:
    """An aborted staging changes nothing anywhere (weights, version, hooks), and the next
    refit, streamed, works as usual."""
    trainer, synchronizer = fresh(fleet, 4)
    try:
        synchronizer.sync_weights()
        hooks = fleet.call("hooks")
        v1 = expected_digests(trainer)
        trainer.step()
        staged = synchronizer.stage_weights()
        synchronizer.abort_weights(staged)
        assert synchronizer.staged is None and synchronizer.version == 1
        assert fleet.call("state_digests") == [v1, v1]
        assert fleet.call("weight_version") == [1, 1]
        assert fleet.call("hooks") == hooks
        assert [e.staged_version for e in synchronizer.status().engines] == [None, None]
        with pytest.raises(RefitError, match="not the pending staging"):
            synchronizer.commit_weights(staged)
        assert synchronizer.sync_weights().version == 3, "2 was staged, then dropped: used"
        assert fleet.call("state_digests") == [expected_digests(trainer)] * 2
    finally:
        synchronizer.shutdown()


@pytest.mark.timeout(300)
def test_an_engine_killed_while_staging_leaves_every_live_engine_serving_old_never_paused(
    fleet: Any,
) -> None:
    """SIGKILL of an engine worker while the others are in the staging transfer fails the
    staging at once, naming it; the survivor never paused (no hook), serves the old version,
    holds nothing staged, and ``recover()`` needs no resync, then readmits a replacement."""
    import ray

    trainer, synchronizer = fresh(fleet, 5)
    victim_pid: int = fleet.call("pid")[1]
    victim = fleet.workers[1]
    try:
        synchronizer.sync_weights()
        v1 = expected_digests(trainer)
        hooks = fleet.call_one(0, "hooks")
        trainer.step()
        fleet.call_one(1, "set_stage_delay", 60.0)
        thread, outcome = failing_in_thread(synchronizer.stage_weights)
        wait_for(
            lambda: ray.get(victim.staging_begun.remote(), timeout=30) > 0,
            "the victim to begin staging",
        )
        killed = time.monotonic()
        kill(victim_pid)
        thread.join(40)
        assert "error" in outcome, "the staging did not fail"
        assert outcome["at"] - killed < 5.0, "the staging waited for its deadline"
        error: RefitError = outcome["error"]
        assert str(error).startswith("staging version 2 failed on shard 1 worker 0: ")
        assert 1 in error.failed_shards
        assert error.states()["shard 0 worker 0"] is EngineState.OLD
        assert synchronizer.staged is None and synchronizer.version == 1
        assert fleet.call_one(0, "hooks") == hooks
        assert fleet.call_one(0, "state_digests") == v1
        assert fleet.call_one(0, "weight_version") == 1
        status = synchronizer.status()
        assert status.shards(EngineHealth.UNREACHABLE) == (1,)
        assert status.engines[0].version == 1 and status.engines[0].staged_version is None

        report = synchronizer.recover()
        assert report.dropped_shards == (1,) and report.resync is None
        assert report.after.engines[0].version == 1
        fleet.restart(1, seed=901)
        rejoined = synchronizer.recover()
        assert rejoined.after.consistent and rejoined.after.agreed_version == 3, "2: used"
        assert fleet.call("state_digests") == [expected_digests(trainer)] * 2
        assert [h[:2] for h in fleet.call_one(0, "hooks")[len(hooks) :]] == [
            ("begin", 3),
            ("commit", 3),
        ]
    finally:
        synchronizer.shutdown()
        restore(fleet, 1, victim, victim_pid, seed=901)


@pytest.mark.timeout(300)
def test_an_engine_killed_between_stage_and_commit_is_named_and_the_others_serve_new(
    fleet: Any,
) -> None:
    """Commit is the point of no return: an engine dead after staging fails the commit,
    named (unknown) while the other serves the new version; ``recover()`` leaves the dead
    shard out with the fleet on one version, then resyncs its replacement."""
    trainer, synchronizer = fresh(fleet, 6)
    victim_pid: int = fleet.call("pid")[1]
    victim = fleet.workers[1]
    try:
        staged = synchronizer.stage_weights()
        kill(victim_pid)
        with pytest.raises(RefitError) as raised:
            synchronizer.commit_weights(staged)
        error = raised.value
        assert str(error).startswith("commit of version 1 failed on shard 1 worker 0: ")
        assert error.recovery is Recovery.RECOVER and error.failed_shards == (1,)
        assert error.states() == {
            "shard 0 worker 0": EngineState.NEW,
            "shard 1 worker 0": EngineState.UNKNOWN,
        }
        assert synchronizer.version == 1 and synchronizer.staged is None
        assert fleet.call_one(0, "state_digests") == expected_digests(trainer)
        assert [h[:2] for h in fleet.call_one(0, "hooks")] == [("begin", 1), ("commit", 1)]

        report = synchronizer.recover()
        assert report.dropped_shards == (1,) and report.resync is None
        assert report.after.shards(EngineHealth.SERVING) == (0,)
        assert report.after.engines[0].version == 1
        fleet.restart(1, seed=902)
        rejoined = synchronizer.recover()
        assert rejoined.resync is not None and rejoined.after.consistent
        assert rejoined.after.agreed_version == synchronizer.version == 2
        assert fleet.call("state_digests") == [expected_digests(trainer)] * 2
    finally:
        synchronizer.shutdown()
        restore(fleet, 1, victim, victim_pid, seed=902)


@pytest.mark.timeout(300)
def test_staging_is_refused_by_name_when_an_engine_participant_cannot_stage(fleet: Any) -> None:
    """One engine worker that cannot stage: ``stage_weights`` raises NotImplementedError
    naming it, before any byte moves; the fleet is untouched and still refits streamed."""
    _, synchronizer = fresh(fleet, 9)
    try:
        before = fleet.call("state_digests")
        fleet.call_one(1, "refuse_staging")
        with pytest.raises(NotImplementedError, match=r"shard 1 worker 0 \(ActorParticipant\)"):
            synchronizer.stage_weights()
        assert synchronizer.staged is None
        assert fleet.call("state_digests") == before and fleet.call("hooks") == [[], []]
        assert fleet.call("staging_begun") == [0, 0]
        assert synchronizer.sync_weights().version == 1
    finally:
        synchronizer.shutdown()


def check_spans(output: GenerationOutput, tokens: int) -> None:
    """Every prompt's spans cover its tokens in order, with at most one switch, upwards."""
    for spans in output.weight_versions:
        assert spans[0].start == 0 and spans[-1].end == tokens
        assert all(a.end == b.start and a.version < b.version for a, b in itertools.pairwise(spans))
        assert len(spans) <= 2


@pytest.mark.timeout(300)
def test_requests_generating_across_stage_and_commit_are_kept_and_switch_once(
    fleet: Any,
) -> None:
    """Each engine decodes back-to-back requests of four prompts while a version is staged
    and committed: no request fails or is lost; each prompt switches at most once (the
    requests in flight at the commit exactly once), its tokens after the switch are a fresh
    engine's on the new weights continuing the same prefix; no token is generated between
    ``on_refit_begin`` and ``on_refit_commit``, and none of them is called while staging."""
    import ray

    trainer, synchronizer = fresh(fleet, 8)
    prompts, new_tokens = [[1, 2, 3], [7, 7, 7, 7], [40, 41], [9, 8, 7, 6, 5]], 40
    stop = threading.Event()
    outputs: dict[int, list[GenerationOutput]] = {0: [], 1: []}
    failures: list[BaseException] = []

    def serve(index: int) -> None:
        worker = fleet.workers[index]
        try:
            while not stop.is_set():
                output = ray.get(worker.generate_output.remote(prompts, new_tokens), timeout=120)
                outputs[index].append(output)
        except BaseException as exc:
            failures.append(exc)

    try:
        synchronizer.sync_weights()
        v1 = dict(trainer.engine_state())
        fleet.call("set_step_delay", 0.02)
        clients = [threading.Thread(target=serve, args=(i,)) for i in (0, 1)]
        for client in clients:
            client.start()
        wait_for(lambda: min(fleet.call("tokens_generated")) > 0, "both engines to generate")
        trainer.step()
        staged = synchronizer.stage_weights()
        hooks_after_staging = fleet.call("hooks")
        result = synchronizer.commit_weights(staged)
        committed_at = [len(outputs[0]), len(outputs[1])]
        wait_for(  # the request in flight at the commit, then one begun after it
            lambda: all(len(outputs[i]) > committed_at[i] + 1 for i in (0, 1)),
            "a request begun after the commit on each engine",
        )
        stop.set()
        for client in clients:
            client.join(120)
        assert not failures, f"requests failed: {failures}"

        assert [[h[:2] for h in hooks] for hooks in hooks_after_staging] == [
            [("begin", 1), ("commit", 1)]
        ] * 2
        for hooks in fleet.call("hooks"):
            (begin, _, at_begin), (commit, _, at_commit) = hooks[-2:]
            assert (begin, commit) == ("begin", "commit") and at_begin == at_commit
        new = dict(trainer.engine_state())
        old_engine, new_engine = ReferenceEngine(CONFIG), ReferenceEngine(CONFIG)
        old_engine.load_weights(v1.items())
        new_engine.load_weights(new.items())
        whole = {
            1: old_engine.generate(prompts, new_tokens).tokens,
            2: new_engine.generate(prompts, new_tokens).tokens,
        }
        switched = 0
        for index in (0, 1):
            for output in outputs[index]:
                check_spans(output, new_tokens)
                for p, (prompt, tokens, spans) in enumerate(
                    zip(prompts, output.tokens, output.weight_versions, strict=True)
                ):
                    if len(spans) == 1:
                        assert tokens == whole[spans[0].version][p]
                        continue
                    switched += 1
                    assert [s.version for s in spans] == [1, 2]
                    at = spans[1].start
                    continued = new_engine.generate([prompt + tokens[:at]], new_tokens - at)
                    assert tokens[at:] == continued.tokens[0]
                    assert tokens[:at] == old_engine.generate([prompt], at).tokens[0]
            assert outputs[index][committed_at[index] + 1].weight_versions == [
                [WeightVersionSpan(2, 0, new_tokens)]
            ] * len(prompts)
        assert switched >= len(prompts), "no request was in flight across the commit"
        logger.info(
            "pause %.4f s, staging %.4f s (%d prompts switched)",
            result.timings_s["pause"],
            result.timings_s["transfer"],
            switched,
        )
    finally:
        stop.set()
        synchronizer.shutdown()
        fleet.call("set_step_delay", 0.0)
