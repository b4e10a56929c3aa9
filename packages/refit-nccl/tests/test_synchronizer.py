"""The collective synchronizer end to end: the factory, Ray engine workers, faults, rejoin."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import pytest

from ray_fleet import CONFIG, PROMPTS, MiB, failing_in_thread, make_synchronizer, wait_for
from refit_core import (
    EngineHealth,
    EngineState,
    GeometryMismatchError,
    Recovery,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
    create_weight_synchronizer,
)
from refit_core.backend import ActorParticipant, LocalParticipant
from refit_lab.conformance import (
    FleetDeployment,
    RefitDeployment,
    SynchronizerConformance,
    trainer_generation,
)
from refit_lab.digest import state_digest
from refit_lab.faults import freeze, kill, thaw
from refit_lab.ray_cluster import LocalCluster
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl import CollectiveOptions, CollectiveWeightSynchronizer, TrainerEndpoint
from refit_nccl.backend import ChildProcessGroup

# Ray is a test tool of the dev group, not a refit-nccl dependency: an environment holding only
# refit-nccl (scripts/test-isolated) skips these Ray-driven tests.
pytest.importorskip("ray", reason="ray (dev group) is not installed")


@pytest.mark.timeout(240)
class TestCollectiveConformance(SynchronizerConformance):
    """The shared conformance suite over two reference-engine shards on Ray."""

    @pytest.fixture(autouse=True)
    def _fresh_fleet(self, fleet: Any) -> None:
        fleet.reset(seed=100)
        self.fleet = fleet

    def create_deployment(self) -> RefitDeployment:
        trainer = SimulatedTrainer(random_checkpoint(CONFIG, 0), lr=1e-2)
        synchronizer = make_synchronizer(trainer, self.fleet)
        return FleetDeployment(trainer, synchronizer, CONFIG, self.fleet)


def digests_match(fleet: Any, trainer: SimulatedTrainer) -> list[bool]:
    expected = state_digest(trainer.engine_state().items())
    return [digests == expected for digests in fleet.call("state_digests")]


def actor_shards(fleet: Any) -> dict[int, list[ActorParticipant]]:
    """The fleet's engine workers as participants, by shard."""
    return {
        index: [ActorParticipant(h, f"shard {index} worker {j}") for j, h in enumerate(hs)]
        for index, hs in fleet.collective_shards().items()
    }


@pytest.mark.timeout(240)
def test_frozen_engine_then_reconcile_over_survivors_and_rejoin(fleet: Any) -> None:
    fleet.reset(seed=200)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 1), lr=1e-2)
    deadline_s = 4.0
    synchronizer = make_synchronizer(trainer, fleet, timeout_s=deadline_s)
    victim_pid: int = fleet.call("pid")[1]
    victim = fleet.workers[1]
    try:
        first = synchronizer.sync_weights()
        assert first.ok and first.timings_s["transfer"] > 0
        assert digests_match(fleet, trainer) == [True, True]

        trainer.step()
        freeze(victim_pid)
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError) as raised:
            synchronizer.sync_weights()
        elapsed = time.monotonic() - started
        assert elapsed <= deadline_s + 2.5, f"sync_weights took {elapsed:.1f} s"
        assert raised.value.wedged_workers == ("shard 1 worker 0",)
        assert synchronizer.is_stale()
        for _ in range(3):  # each status waits one probe (1 s here) for the frozen engine
            started = time.monotonic()
            frozen = synchronizer.status()
            assert time.monotonic() - started < deadline_s / 2, "not the deadline"
            assert frozen.shards(EngineHealth.UNREACHABLE) == (1,)
        import ray

        def shard0_status() -> Any:
            return ray.get(fleet.workers[0].refit_status.remote(), timeout=60)

        assert shard0_status().committed_version == 1, "a failed refit commits nothing"
        give_up = time.monotonic() + 30  # the controller's abort is fire-and-forget
        while shard0_status().connected and time.monotonic() < give_up:
            time.sleep(0.05)
        assert shard0_status().abort_cause is not None
        with pytest.raises(RefitAbortedError, match="reconcile"):
            synchronizer.sync_weights()

        synchronizer.reconcile_communicator({1})
        assert not synchronizer.is_stale()
        membership = synchronizer.membership
        assert membership is not None and membership.shard_indices == (0,)
        retried = synchronizer.sync_weights()
        # versions 2 (failed) and 3 (refused: stale) were tried: never again
        assert retried.version == 4 and [w.worker for w in retried.workers] == ["shard 0 worker 0"]
        shard0 = fleet.workers[0]
        expected = state_digest(trainer.engine_state().items())
        assert ray.get(shard0.state_digests.remote(), timeout=60) == expected

        fleet.restart(1, seed=300)  # the frozen shard is replaced by a fresh process
        assert synchronizer.is_stale()
        synchronizer.reconcile_communicator(())
        trainer.step()
        rejoined = synchronizer.sync_weights()
        assert rejoined.ok and len(rejoined.workers) == 2
        assert digests_match(fleet, trainer) == [True, True]
        assert fleet.call("weight_version") == [5, 5]
        expected_tokens = trainer_generation(trainer, CONFIG, PROMPTS, 5)
        assert fleet.call("generate", PROMPTS, 5) == [expected_tokens, expected_tokens]
    finally:
        thaw(victim_pid)
        kill(victim_pid)
        synchronizer.shutdown()
        if fleet.workers[1] is victim:  # failed before the restart: leave a whole fleet behind
            fleet.restart(1, seed=300)


@pytest.mark.timeout(120)
def test_buffer_size_that_engines_did_not_declare_is_refused(fleet: Any) -> None:
    fleet.reset(seed=400)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 2))
    synchronizer = make_synchronizer(trainer, fleet, buffer_gb=0.5)
    with synchronizer, pytest.raises(GeometryMismatchError, match="refit_buffer_size_gb"):
        synchronizer.init_communicator()


class MeetingPoint:
    """A train_cluster with only the rendezvous method the collective row calls."""

    def __init__(self) -> None:
        self._cluster = LocalCluster(1)

    def get_master_address_and_port(self) -> tuple[str, int]:
        return self._cluster.get_master_address_and_port()


@dataclass(frozen=True)
class OtherOptions:
    buffer_size_bytes: int | None = None


@pytest.mark.timeout(120)
def test_options_and_a_rendezvous_only_cluster_through_the_factory(fleet: Any) -> None:
    fleet.reset(seed=450)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 4))

    def build(options: object, **kwargs: Any) -> Any:
        return create_weight_synchronizer(
            trainer, fleet, "vllm", False, train_cluster=MeetingPoint(), refit_timeout_s=30.0,
            options=options, **kwargs,
        )  # fmt: skip

    with pytest.raises(ValueError, match="must be CollectiveOptions"):
        build(OtherOptions())
    with pytest.raises(ValueError, match="disagree"):
        build(CollectiveOptions(buffer_size_bytes=2 * MiB), refit_buffer_size_gb=1.0)
    refused = build(CollectiveOptions(buffer_size_bytes=2 * MiB))
    with refused, pytest.raises(GeometryMismatchError, match="options.buffer_size_bytes"):
        refused.init_communicator()
    accepted = build(CollectiveOptions(buffer_size_bytes=MiB, grace_s=2.0))
    with accepted:
        assert accepted.sync_weights().version == 1
        assert digests_match(fleet, trainer) == [True, True]


@pytest.mark.timeout(120)
def test_state_that_does_not_fit_the_engines_is_refused_at_init(fleet: Any) -> None:
    fleet.reset(seed=500)
    other = ReferenceModelConfig(
        vocab_size=512, hidden_size=128, num_layers=2, intermediate_size=384
    )
    trainer = SimulatedTrainer(random_checkpoint(other, 3))
    synchronizer = make_synchronizer(trainer, fleet)
    with synchronizer, pytest.raises(GeometryMismatchError, match="missing model.layers.2"):
        synchronizer.init_communicator()
    assert fleet.call("weight_version") == [0, 0]


@pytest.mark.timeout(120)
def test_every_trainer_rank_joins_and_only_rank_0_sends(fleet: Any) -> None:
    """Two trainer ranks in this process (rank 1 receives and discards) and the Ray engines."""
    fleet.reset(seed=600)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 4), lr=1e-2)
    idle = SimulatedTrainer(random_checkpoint(CONFIG, 5))  # rank 1 never sends its weights
    trainers = [
        LocalParticipant(TrainerEndpoint(t), f"trainer {r}") for r, t in enumerate((trainer, idle))
    ]
    synchronizer = CollectiveWeightSynchronizer(
        trainers,
        lambda: actor_shards(fleet),
        LocalCluster(2).get_master_address_and_port,
        refit_timeout_s=30,
    )
    with synchronizer:
        result = synchronizer.sync_weights()
        membership = synchronizer.membership
        assert membership is not None and (membership.trainers, membership.world_size) == (2, 4)
        assert result.ok and len(result.workers) == 2
        assert digests_match(fleet, trainer) == [True, True]


@pytest.mark.timeout(300)
def test_communicators_in_children_and_a_reconcile_starts_fresh_ones(fleet: Any) -> None:
    """``communicator_in_child``: every participant's communicator runs in a killable child;
    a reconcile rebuilds the group with fresh children, and the refits stay bitwise."""
    fleet.reset(seed=700)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 6), lr=1e-2)
    endpoint = TrainerEndpoint(trainer)
    synchronizer = CollectiveWeightSynchronizer(
        [LocalParticipant(endpoint, "trainer 0")],
        lambda: actor_shards(fleet),
        LocalCluster(1).get_master_address_and_port,
        refit_timeout_s=120,
        options=CollectiveOptions(communicator_in_child=True),
    )
    with synchronizer:
        assert synchronizer.sync_weights().ok
        first = endpoint._group
        assert isinstance(first, ChildProcessGroup)
        assert digests_match(fleet, trainer) == [True, True]

        synchronizer.reconcile_communicator({1})
        trainer.step()
        assert synchronizer.sync_weights().ok
        assert first.aborted and isinstance(endpoint._group, ChildProcessGroup)
        assert digests_match(fleet, trainer)[0]

        synchronizer.reconcile_communicator(())
        trainer.step()
        assert synchronizer.sync_weights().ok
        assert digests_match(fleet, trainer) == [True, True]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_ranks_as_ray_actors_through_the_factory(fleet: Any) -> None:
    import ray

    from ray_actors import ACTOR_OPTIONS, RemoteTrainerWorker

    fleet.reset(seed=700)
    actors: list[Any] = [
        RemoteTrainerWorker.options(**ACTOR_OPTIONS).remote(CONFIG, 6) for _ in range(2)
    ]

    class RayPolicy:
        def collective_trainers(self) -> list[Any]:
            return actors

    try:
        with make_synchronizer(RayPolicy(), fleet) as synchronizer:
            ray.get(actors[0].step.remote(), timeout=120)
            assert synchronizer.sync_weights().ok
            expected = ray.get(actors[0].engine_digests.remote(), timeout=60)
            assert fleet.call("state_digests") == [expected, expected]
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


@pytest.mark.timeout(300)
def test_a_dead_engine_ends_the_refit_at_once_and_recover_restores_one_version(
    fleet: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With a 30 s deadline, SIGKILL of an engine worker mid-transfer fails the refit within
    a second (not at the deadline), the survivor is closed (it loaded part of the refit and
    generates nothing), the error says so per engine, and ``recover()`` brings the fleet to
    one version: first without the dead shard, then with its replacement."""
    import ray

    fleet.reset(seed=800)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 7), lr=1e-2)
    synchronizer = make_synchronizer(trainer, fleet, timeout_s=30.0)
    victim_pid: int = fleet.call("pid")[1]
    survivor, victim = fleet.workers[0], fleet.workers[1]
    try:
        assert synchronizer.sync_weights().version == 1
        fleet.call("set_load_delay", 0.1)
        trainer.step()
        thread, outcome = failing_in_thread(synchronizer.sync_weights)
        wait_for(
            lambda: ray.get(fleet.workers[1].refit_status.remote(), timeout=30).closed,
            "the victim to start loading",
        )
        killed = time.monotonic()
        kill(victim_pid)
        thread.join(40)
        assert "error" in outcome, "the refit did not fail"
        latency = outcome["at"] - killed
        assert latency < 1.0, f"the refit failed {latency:.2f} s after the death (deadline 30 s)"
        error: RefitError = outcome["error"]
        assert str(error).startswith("refit to version 2 failed on shard 1 worker 0: ")
        assert error.recovery is Recovery.RECOVER and 1 in error.failed_shards
        states = error.states()
        assert states["shard 1 worker 0"] is EngineState.UNKNOWN
        assert states["shard 0 worker 0"] is EngineState.CLOSED
        with pytest.raises(ray.exceptions.RayTaskError, match="EngineClosedError"):
            ray.get(survivor.generate.remote(PROMPTS, 3), timeout=60)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            statuses = [synchronizer.status() for _ in range(3)]
        dead = [r for r in caplog.records if "ActorDiedError" in r.getMessage()]
        assert dead == [], "the death was told once, with the refit's error"
        for status in statuses:
            assert status.shards(EngineHealth.UNREACHABLE) == (1,)
            assert status.shards(EngineHealth.CLOSED) == (0,)
            assert "ActorDiedError" in (status.engines[1].detail or "")

        ray.get(survivor.set_load_delay.remote(0.0), timeout=30)
        report = synchronizer.recover()
        assert report.dropped_shards == (1,)
        assert report.resync is not None and report.resync.version == 3, "2 failed: not reused"
        expected = state_digest(trainer.engine_state().items())
        assert ray.get(survivor.state_digests.remote(), timeout=60) == expected
        expected_tokens = trainer_generation(trainer, CONFIG, PROMPTS, 5)
        assert ray.get(survivor.generate.remote(PROMPTS, 5), timeout=60) == expected_tokens

        fleet.restart(1, seed=900)
        rejoined = synchronizer.recover()
        assert rejoined.dropped_shards == ()
        assert rejoined.resync is not None and rejoined.after.consistent
        assert rejoined.after.agreed_version == synchronizer.version == 4
        assert digests_match(fleet, trainer) == [True, True]
    finally:
        synchronizer.shutdown()
        if fleet.workers[0] is survivor:
            ray.get(survivor.set_load_delay.remote(0.0), timeout=30)
        kill(victim_pid)
        if fleet.workers[1] is victim:  # failed before the restart: leave a whole fleet behind
            fleet.restart(1, seed=900)


@pytest.mark.parametrize("status_timeout_s", [None, 0.5, 2.5])
def test_the_status_probe_fits_the_deadline_or_is_refused(
    fleet: Any, status_timeout_s: float | None
) -> None:
    """status_timeout_s is derived from the deadline (a tenth, within [1, 2] s) or refused
    when the synchronizer is built if it takes more than a quarter of the deadline (a fleet
    with a frozen engine could not be asked and rebuilt within it)."""
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 1))
    options = CollectiveOptions(status_timeout_s=status_timeout_s)

    def build() -> Any:
        return create_weight_synchronizer(
            trainer,
            fleet,
            "vllm",
            False,
            train_cluster=LocalCluster(1),
            refit_timeout_s=8.0,
            options=options,
        )

    if status_timeout_s is not None and status_timeout_s > 2.0:
        with pytest.raises(ValueError, match="status_timeout_s=2.5 does not fit"):
            build()
        return
    build().shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", ["before the refit", "in the middle"])
def test_a_lost_trainer_is_always_a_timeout(fleet: Any, killed: str) -> None:
    """The same fault raises the same error: a trainer rank whose process dies (before the
    refit, or while the engines wait in its transfer) is a lost peer: a
    ``RefitTimeoutError`` that needs ``recover()``, whichever participant reports first."""
    import ray

    from ray_actors import ACTOR_OPTIONS, RemoteTrainerWorker

    fleet.reset(seed=1100)
    trainer = RemoteTrainerWorker.options(**ACTOR_OPTIONS).remote(CONFIG, 11)

    class RayPolicy:
        def collective_trainers(self) -> list[Any]:
            return [trainer]

    synchronizer = make_synchronizer(RayPolicy(), fleet, timeout_s=30.0)
    try:
        synchronizer.sync_weights()
        if killed == "before the refit":
            ray.kill(trainer, no_restart=True)
        else:
            ray.get(trainer.set_transfer_delay.remote(5.0), timeout=60)
        thread, outcome = failing_in_thread(synchronizer.sync_weights)
        if killed == "in the middle":
            time.sleep(0.5)
            ray.kill(trainer, no_restart=True)
        thread.join(60)
        error = outcome["error"]
        assert type(error) is RefitTimeoutError, repr(error)
        assert error.recovery is Recovery.RECOVER
    finally:
        synchronizer.shutdown()
