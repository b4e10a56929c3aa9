"""The zmq_sparse synchronizer end to end: the factory, relays beside Ray engine workers,
the conformance suite, sparse refits, stale engines and dead relays."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from sparse_actors import CONFIG, EngineFleet, RayTrainer

from refit_core import (
    EngineHealth,
    EngineState,
    Recovery,
    RefitTimeoutError,
    WorkerError,
    create_weight_synchronizer,
)
from refit_lab.conformance import FleetDeployment, RefitDeployment, SynchronizerConformance
from refit_lab.digest import state_digest
from refit_lab.ray_cluster import LocalCluster
from refit_lab.reference_engine import random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_zmq.relay import RelayTuning
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer

pytestmark = pytest.mark.timeout(300)

OPTIONS = ZmqSparseOptions(
    shard_count=2,
    bucket_size_bytes=256 * 1024,
    call_timeout_s=5.0,
    verify_digests=True,
    tuning=RelayTuning(chunk_bytes=64 * 1024, max_inflight_bytes=16 << 20, retries=1),
)


class TestZmqSparseConformance(SynchronizerConformance):
    """The shared suite, through the factory, over three engine workers with relays."""

    @pytest.fixture(autouse=True)
    def _fresh_engines(self, engines: EngineFleet) -> None:
        engines.reset(seed=100)
        self.engines = engines

    def create_deployment(self) -> RefitDeployment:
        trainer = SimulatedTrainer(random_checkpoint(CONFIG, 0), lr=1e-2)
        synchronizer = create_weight_synchronizer(
            trainer,
            self.engines,
            "vllm",
            False,
            refit_timeout_s=60.0,
            transport="zmq_sparse",
        )  # no clusters: the sparse row calls none
        assert isinstance(synchronizer, ZmqSparseWeightSynchronizer)
        return FleetDeployment(trainer, synchronizer, CONFIG, self.engines)


class _Relays:
    """A generation of the given relays only."""

    def __init__(self, addresses: list[str]) -> None:
        self._addresses = addresses

    def relay_addresses(self) -> list[str]:
        return list(self._addresses)


def _synchronizer(
    trainer: SimulatedTrainer, engines: EngineFleet | _Relays
) -> ZmqSparseWeightSynchronizer:
    synchronizer = create_weight_synchronizer(
        trainer, engines, "vllm", False, refit_timeout_s=60.0, transport="zmq_sparse",
        options=OPTIONS,
    )  # fmt: skip
    assert isinstance(synchronizer, ZmqSparseWeightSynchronizer)
    return synchronizer


def _bitwise(engines: EngineFleet, trainer: SimulatedTrainer) -> list[bool]:
    expected = state_digest(trainer.engine_state().items())
    return [digests == expected for digests in engines.call("state_digests")]


def test_refits_go_sparse_and_a_restarted_engine_is_resynced_densely(engines: EngineFleet) -> None:
    engines.reset(seed=300)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 3))
    with _synchronizer(trainer, engines) as synchronizer:
        first = synchronizer.sync_weights()
        assert first.wire_bytes >= first.dense_bytes // 2, "the first refit is a dense resync"
        trainer.step()
        second = synchronizer.sync_weights()
        assert second.ok and _bitwise(engines, trainer) == [True] * 3
        assert second.changed_elements > 0
        assert second.wire_bytes < second.dense_bytes / 4, "an AdamW step travels sparse"
        assert {k for k in second.timings_s if k.startswith("apply:")} == {
            f"apply:{a}" for a in engines.relay_addresses()
        }

        ray.get(engines.workers[1].reset.remote(999), timeout=60)  # other bits, version 0
        with pytest.raises(RefitTimeoutError, match="do not answer"):
            synchronizer.sync_weights()  # its relay came back on another port
        assert synchronizer.is_stale()
        synchronizer.reconcile_communicator(())  # the tree over the current addresses
        trainer.step()
        third = synchronizer.sync_weights()
        assert third.wire_bytes >= third.dense_bytes // 2, "the stale engine forces a resync"
        assert _bitwise(engines, trainer) == [True] * 3
        assert engines.call("weight_version") == [third.version] * 3


def test_dead_relay_is_named_then_left_out(engines: EngineFleet) -> None:
    engines.reset(seed=400)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 4))
    with _synchronizer(trainer, engines) as synchronizer:
        synchronizer.sync_weights()
        addresses = engines.relay_addresses()
        dead = addresses[2]
        ray.get(engines.workers[2].stop_relay.remote(), timeout=60)
        trainer.step()
        with pytest.raises(RefitTimeoutError, match=dead) as failed:
            synchronizer.sync_weights()
        error = failed.value
        assert error.failed_shards == (2,) and error.recovery is Recovery.RECOVER
        assert [(e.shard, e.worker, e.state) for e in error.engines] == [
            (0, addresses[0], EngineState.OLD),
            (1, addresses[1], EngineState.OLD),
            (2, dead, EngineState.UNKNOWN),
        ]
        assert error.wedged_workers == (dead,)
        assert str(error).startswith(f"relays {dead} (shard 2) do not answer")
        assert isinstance(error.__cause__, RefitTimeoutError), "the relay's own error, chained"
        assert synchronizer.is_stale()
        synchronizer.reconcile_communicator({2})
        assert not synchronizer.is_stale()
        result = synchronizer.sync_weights()
        assert {w.worker for w in result.workers} == set(engines.relay_addresses()[:2])
        assert _bitwise(engines, trainer)[:2] == [True, True]


def test_engines_whose_relays_apply_in_place_cannot_stage(engines: EngineFleet) -> None:
    engines.reset(seed=450)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 4))
    with _synchronizer(trainer, engines) as synchronizer:
        with pytest.raises(NotImplementedError, match="ZmqSparseWeightSynchronizer cannot stage"):
            synchronizer.stage_weights()
        assert synchronizer.staged is None
        assert synchronizer.sync_weights().version == 1, "a one-phase refit still runs"


def _ray_synchronizer(trainer: RayTrainer, engines: EngineFleet) -> Any:
    return create_weight_synchronizer(
        trainer,
        engines,
        "vllm",
        False,
        train_cluster=LocalCluster(len(trainer.ranks)),
        inference_cluster=LocalCluster(3),
        refit_timeout_s=30.0,
        transport="zmq_sparse",
    )


def test_trainer_ranks_on_ray_each_stream_their_shard(engines: EngineFleet) -> None:
    engines.reset(seed=500)
    ranks = RayTrainer(2, checkpoint_seed=5)
    twin = SimulatedTrainer(random_checkpoint(CONFIG, 5))  # the ranks' replica, stepped alike
    try:
        with _ray_synchronizer(ranks, engines) as synchronizer:
            first = synchronizer.sync_weights()
            assert first.ok and _bitwise(engines, twin) == [True] * 3
            ranks.step()
            twin.step()
            second = synchronizer.sync_weights()
            assert second.ok and _bitwise(engines, twin) == [True] * 3
            assert 0 < second.wire_bytes < second.dense_bytes / 4, "each rank sent its delta"
            assert engines.call("weight_version") == [second.version] * 3
    finally:
        ranks.close()


def test_dead_trainer_rank_is_named_and_engines_keep_their_version(engines: EngineFleet) -> None:
    engines.reset(seed=600)
    ranks = RayTrainer(2, checkpoint_seed=6)
    twin = SimulatedTrainer(random_checkpoint(CONFIG, 6))
    try:
        with _ray_synchronizer(ranks, engines) as synchronizer:
            committed = synchronizer.sync_weights().version
            ray.kill(ranks.ranks[1], no_restart=True)
            with pytest.raises(WorkerError, match="trainer rank 1") as failed:
                synchronizer.sync_weights()
            assert [(e.state, e.version) for e in failed.value.engines] == [
                (EngineState.OLD, committed)
            ] * 3, "every relay confirmed the rollback"
            assert failed.value.recovery is Recovery.RECOVER and failed.value.__cause__ is not None
            assert engines.call("weight_version") == [committed] * 3
            assert _bitwise(engines, twin) == [True] * 3, "nothing was half applied"
    finally:
        ranks.close()


def test_status_and_recover_after_a_dead_relay_then_a_restarted_controller(
    engines: EngineFleet,
) -> None:
    """status() reports each relay's engine; recover() drops the dead relay and leaves the
    rest on one version; a new synchronizer over the survivors adopts their version."""
    engines.reset(seed=700)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 7))
    with _synchronizer(trainer, engines) as synchronizer:
        committed = synchronizer.sync_weights().version
        before = synchronizer.status()
        assert before.serving() == {committed: (0, 1, 2)} and before.consistent
        addresses = engines.relay_addresses()
        ray.get(engines.workers[2].stop_relay.remote(), timeout=60)
        trainer.step()
        with pytest.raises(RefitTimeoutError):
            synchronizer.sync_weights()
        broken = synchronizer.status()
        assert broken.shards(EngineHealth.UNREACHABLE) == (2,)
        assert broken.serving() == {committed: (0, 1)}
        report = synchronizer.recover()
        assert report.dropped_shards == (2,)
        assert report.resync is None, "the survivors already served one version"
        assert report.after.serving() == {committed: (0, 1)}
        result = synchronizer.sync_weights()
        assert {w.worker for w in result.workers} == set(addresses[:2])
        assert _bitwise(engines, trainer)[:2] == [True, True]
    restarted = _synchronizer(trainer, _Relays(addresses[:2]))
    with restarted:
        trainer.step()
        assert restarted.sync_weights().version == result.version + 1, "adopted, not version 1"
        assert _bitwise(engines, trainer)[:2] == [True, True]
