"""Refit while serving on the collective row: refit-nccl into a real vLLM ``AsyncLLM`` of two
tensor-parallel workers.

Each worker receives the next version into host memory on a thread of its own while the engine
keeps generating (the controller polls the workers between engine steps), and the commit
pauses the engine in vLLM's ``keep`` mode only to load the staged copy. Eight requests generate
during staging and eight cross the commit with one switch each (vLLM's own
``weight_versions``), their tokens after it the new weights' own. A trainer killed half-way
through a staging leaves the engine serving its version, never paused, released within the
deadline; a later staged refit works.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from child_trainer import ChildParticipant, collective_trainer
from engine_helpers import CheckpointPolicy, Checkpoints, factory_synchronizer
from inflight_helpers import (
    Served,
    check_requests_cross_a_commit,
    served_as_without_a_refit,
    serving,
)

from refit_core import EngineState, RefitError, WeightSynchronizer
from refit_lab.ray_cluster import LocalCluster

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

TP = 2
BUCKET_BYTES = 1 << 20  # a refit of the tier's model takes several buckets
DEADLINE_S = 60.0
KILLED_DEADLINE_S = 10.0  # the staging whose trainer dies waits this long at most


@pytest.fixture(scope="module")
def served(checkpoints: Checkpoints) -> Iterator[Served]:
    from refit_nccl.vllm import engine_args

    with serving(checkpoints.paths["B'"], engine_args(), tp=TP) as engine:
        yield engine


def _generation(served: Served) -> Any:
    from refit_nccl.vllm import VllmCollectiveGeneration

    return VllmCollectiveGeneration([served.client], buffer_size_bytes=BUCKET_BYTES)


def _in_process(served: Served, policy: CheckpointPolicy) -> WeightSynchronizer:
    """The factory's collective synchronizer from a trainer in this process (one participant
    per worker)."""
    generation = _generation(served)
    assert len(generation.collective_shards()[0]) == TP
    synchronizer: WeightSynchronizer = factory_synchronizer(policy, generation, DEADLINE_S)
    return synchronizer


def test_requests_in_flight_cross_a_staged_collective_commit(
    served: Served, checkpoints: Checkpoints
) -> None:
    policy = CheckpointPolicy(checkpoints, "B'")
    with _in_process(served, policy) as synchronizer:
        synchronizer.sync_weights(1)  # a full refit to the bits it serves
        check_requests_cross_a_commit(served, synchronizer, policy, "B''")


def test_a_trainer_killed_while_staging_leaves_the_served_version_and_never_pauses(
    served: Served, checkpoints: Checkpoints
) -> None:
    from refit_nccl import CollectiveTrainerRole, CollectiveWeightSynchronizer

    version = int(served.client.weight_version())
    names = len(checkpoints.tensors["A"])
    trainer = ChildParticipant(
        "trainer 0", collective_trainer, [checkpoints.paths["A"]], "kill", names // 2
    )
    trainer.call(CollectiveTrainerRole.refit_state).result(timeout=120)  # started
    synchronizer = CollectiveWeightSynchronizer(
        [trainer],
        _generation(served).collective_shards,
        LocalCluster(1).get_master_address_and_port,
        refit_timeout_s=KILLED_DEADLINE_S,
    )
    try:
        synchronizer.init_communicator()  # adopts the version the engine serves
        assert synchronizer.version == version
        with served_as_without_a_refit(served, synchronizer):
            started = time.monotonic()
            with pytest.raises(RefitError) as killed:
                synchronizer.stage_weights(version + 1)
            assert time.monotonic() - started < KILLED_DEADLINE_S + 2.0, "released"
            assert trainer.process.exitcode is not None, "the trainer died mid-staging"
            assert [e.state for e in killed.value.engines] == [EngineState.OLD]
            assert {e.version for e in killed.value.engines} == {version}
    finally:
        synchronizer.shutdown()
        trainer.close()

    policy = CheckpointPolicy(checkpoints, "A")
    with _in_process(served, policy) as retry:
        staged = retry.stage_weights()  # above version + 1: it began staging, never reused
        assert staged.version == version + 2
        retry.commit_weights(staged)
    assert served.client.weight_version() == str(version + 2)
