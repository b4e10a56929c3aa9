"""refit-nccl's packed collective into real vLLM engines (tensor-parallel 1 and 2): the
trainer in this process or, for the failure tests, in a process of its own that kills or
freezes itself mid-transfer; the receivers in every worker, through the factory.

A failed refit leaves a staged engine (the default) on exactly its previous weights, serving;
a streaming engine whose model was written stays closed (requests held, none answered) until
a complete refit reopens it on the new weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from child_trainer import ChildParticipant, collective_trainer
from dense_checks import closed_until_a_refit, previous_weights_after, refits_away_and_back
from engine_helpers import (
    CheckpointPolicy,
    Checkpoints,
    Engine,
    FreshOutputs,
    factory_synchronizer,
    generate,
    running_engine,
)
from stale_kernel import failed_verification, stale_kernel
from timing_checks import timings_add_up

from refit_core import (
    GeometryMismatchError,
    RefitError,
    WeightSynchronizer,
)
from refit_lab.ray_cluster import LocalCluster

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUCKET_BYTES = 1 << 20  # the smallest geometry: a refit of the tier's model takes 4 buckets
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def checkpoints(tied_checkpoints: Checkpoints) -> Checkpoints:
    """The module refits a model with tied embeddings."""
    return tied_checkpoints


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(
    request: pytest.FixtureRequest, checkpoints: Checkpoints, fresh_outputs: FreshOutputs
) -> Iterator[Engine]:
    from refit_nccl.vllm import engine_args

    with running_engine(checkpoints, engine_args(), request.param, fresh_outputs) as running:
        yield running


def _generation(engine: Engine, *, staged: bool = True) -> Any:
    from refit_nccl.vllm import VllmCollectiveGeneration

    return VllmCollectiveGeneration([engine.llm], staged=staged, buffer_size_bytes=BUCKET_BYTES)


def _synchronizer(policy: Any, generation: Any) -> WeightSynchronizer:
    synchronizer: WeightSynchronizer = factory_synchronizer(policy, generation, 120.0)
    return synchronizer


def _refit(engine: Engine, checkpoints: Checkpoints, state: str, *, staged: bool = True) -> int:
    """A complete refit to ``state`` from a trainer in this process."""
    with _synchronizer(
        CheckpointPolicy(checkpoints, state), _generation(engine, staged=staged)
    ) as sync:
        return sync.sync_weights(engine.next_version()).version


def _failing(engine: Engine, checkpoints: Checkpoints, fault: str, *, staged: bool) -> RefitError:
    """A refit to A whose trainer process faults itself three quarters of the way through its
    tensors: by then the first buckets are wholly sent (the trainer packs a third only once the
    first one's broadcast ended), so a streamed engine has loaded some of the refit."""
    from refit_nccl import CollectiveTrainerRole, CollectiveWeightSynchronizer

    names = len(checkpoints.tensors["A"])
    trainer = ChildParticipant(
        "trainer 0", collective_trainer, [checkpoints.paths["A"]], fault, names * 3 // 4
    )
    trainer.call(CollectiveTrainerRole.refit_state).result(
        timeout=120
    )  # started: the deadline is the refit's
    generation = _generation(engine, staged=staged)
    synchronizer = CollectiveWeightSynchronizer(
        [trainer],
        generation.collective_shards,
        LocalCluster(1).get_master_address_and_port,
        refit_timeout_s=DEADLINE_S,
    )
    try:
        with pytest.raises(RefitError) as failed:
            synchronizer.sync_weights(engine.next_version())
        return failed.value
    finally:
        synchronizer.shutdown()
        trainer.close()


def test_every_worker_receives_and_refits_equal_vllms_own_load(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    assert len(_generation(engine).collective_shards()[0]) == engine.tp
    refits_away_and_back(
        engine, lambda state, staged: _refit(engine, checkpoints, state, staged=staged)
    )


def test_a_cpu_worker_declares_host_buckets_unless_told_otherwise(engine: Engine) -> None:
    from refit_nccl import CollectiveEngineRole
    from refit_nccl.backend import HOST_GEOMETRY
    from refit_nccl.vllm import VllmCollectiveGeneration

    # An engine's workers answer together: every worker is called before any result is read.
    (workers,) = VllmCollectiveGeneration([engine.llm]).collective_shards().values()
    asked = [w.call(CollectiveEngineRole.refit_geometry) for w in workers]
    assert [f.result(60) for f in asked] == [HOST_GEOMETRY] * engine.tp
    (workers,) = _generation(engine).collective_shards().values()
    asked = [w.call(CollectiveEngineRole.refit_geometry) for w in workers]
    assert [f.result(60).buffer_size_bytes for f in asked] == [BUCKET_BYTES] * engine.tp


def test_state_that_does_not_fit_the_engine_is_refused_before_any_byte(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    checkpoints.tensors["wrong"] = {
        name: tensor[:1] if name == "model.embed_tokens.weight" else tensor
        for name, tensor in checkpoints.tensors["A"].items()
    }
    with (
        _synchronizer(CheckpointPolicy(checkpoints, "wrong"), _generation(engine)) as sync,
        pytest.raises(GeometryMismatchError, match=r"model\.embed_tokens\.weight"),
    ):
        sync.sync_weights(engine.next_version())
    assert generate(engine.llm) == engine.expected["B'"], "the engine still serves what it had"


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_staged_refit_whose_trainer_fails_mid_transfer_leaves_the_previous_weights(
    engine: Engine, checkpoints: Checkpoints, fault: str
) -> None:
    served = engine.llm.llm_engine.get_weight_version()
    error = _failing(engine, checkpoints, fault, staged=True)
    previous_weights_after(
        engine,
        error,
        served,
        lambda state, staged: _refit(engine, checkpoints, state, staged=staged),
    )


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_streamed_refit_whose_trainer_fails_mid_transfer_closes_the_engine_until_a_refit(
    engine: Engine, checkpoints: Checkpoints, fault: str
) -> None:
    error = _failing(engine, checkpoints, fault, staged=False)
    closed_until_a_refit(
        engine, error, lambda state, staged: _refit(engine, checkpoints, state, staged=staged)
    )


def test_a_new_controller_adopts_the_version_the_engine_serves(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    """A second generation and synchronizer (a restarted controller) over an engine serving
    version N report N, not 0, and refit N+1 without being told a version."""
    served = _refit(engine, checkpoints, "A")
    with _synchronizer(CheckpointPolicy(checkpoints, "B'"), _generation(engine)) as sync:
        status = sync.status()
        assert status.serving() == {served: (0,)} and status.high_water_mark == served
        assert sync.sync_weights().version == served + 1
    engine.version = max(engine.version, served + 1)
    assert generate(engine.llm) == engine.expected["B'"]


def test_a_load_that_leaves_a_kernel_on_the_old_weights_fails_and_closes_the_engine(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    with stale_kernel(engine.llm), pytest.raises(RefitError) as failed:
        _refit(engine, checkpoints, "A")
    assert failed_verification(failed.value), failed.value
    closed_until_a_refit(
        engine,
        failed.value,
        lambda state, staged: _refit(engine, checkpoints, state, staged=staged),
    )


def test_timings_name_the_whole_call_the_load_included(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    with _synchronizer(CheckpointPolicy(checkpoints, "A"), _generation(engine)) as sync:
        # the first refit sets the group up (``connect``); the commit loads the model
        for _ in range(2):
            timings_add_up(sync, engine.next_version(), ("connect", "transfer", "commit"))
    assert generate(engine.llm) == engine.expected["A"]
    _refit(engine, checkpoints, "B'")
