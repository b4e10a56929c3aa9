"""refit-zmq's colocated IPC channel into real vLLM engines on this host (tensor-parallel 1 and
2): shared-memory buffers, every worker serving inside vLLM's update session, through the
factory; for the failure tests the trainer (refit-zmq's own IPC synchronizer) runs in a process
of its own that is killed, frozen, or sends a corrupted bucket mid-refit.

A failed refit leaves a staged engine (the default) on exactly its previous weights, serving;
a streaming engine whose model was written stays closed (requests held, none answered) until
a complete refit reopens it on the new weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from child_trainer import ChildParticipant, IpcTrainer, ipc_trainer
from dense_checks import closed_until_a_refit, previous_weights_after, refits_away_and_back
from engine_helpers import (
    CheckpointPolicy,
    Checkpoints,
    Engine,
    FreshOutputs,
    generate,
    running_engine,
)
from stale_kernel import failed_verification, stale_kernel
from timing_checks import timings_add_up

from refit_core import (
    GeometryMismatchError,
    RefitError,
    WeightSynchronizer,
    create_weight_synchronizer,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUFFER_BYTES = 256 << 10  # 256 KiB buffers: many buckets, one-off buffers for the embeddings
DEADLINE_S = 10.0
FAULTS = [("kill", None), ("freeze", None), (None, 3)]
"""(self-inflicted fault, corrupted bucket): killed, frozen, or the third bucket corrupted."""


@pytest.fixture(scope="module")
def checkpoints(tied_checkpoints: Checkpoints) -> Checkpoints:
    """The module refits a model with tied embeddings."""
    return tied_checkpoints


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(
    request: pytest.FixtureRequest, checkpoints: Checkpoints, fresh_outputs: FreshOutputs
) -> Iterator[Engine]:
    from refit_zmq.vllm import engine_args

    with running_engine(checkpoints, engine_args("ipc"), request.param, fresh_outputs) as running:
        yield running


def _generation(engine: Engine, *, staged: bool = True) -> Any:
    from refit_zmq.vllm import VllmIpcGeneration

    return VllmIpcGeneration([engine.llm], staged=staged)


def _synchronizer(policy: Any, generation: Any) -> WeightSynchronizer:
    return create_weight_synchronizer(
        policy,
        generation,
        "vllm",
        True,
        refit_buffer_size_gb=BUFFER_BYTES / (1 << 30),
        refit_timeout_s=120.0,
    )


def _refit(engine: Engine, checkpoints: Checkpoints, state: str, *, staged: bool = True) -> int:
    """A complete refit to ``state`` from a trainer in this process."""
    generation = _generation(engine, staged=staged)
    try:
        with _synchronizer(CheckpointPolicy(checkpoints, state), generation) as sync:
            return sync.sync_weights(engine.next_version()).version
    finally:
        generation.close()


def _failing(
    engine: Engine,
    checkpoints: Checkpoints,
    fault: str | None,
    corrupt: int | None,
    *,
    staged: bool,
) -> RefitError:
    """A refit to A whose trainer process fails half-way (the sessions, opened here as the
    synchronizer's own ``RefitSessions`` would, end by the deadline)."""
    generation = _generation(engine, staged=staged)
    version = engine.next_version()
    arguments = (generation.ipc_addresses(), DEADLINE_S, BUFFER_BYTES, corrupt)
    names = len(checkpoints.tensors["A"])
    trainer = ChildParticipant(
        "trainer", ipc_trainer, [checkpoints.paths["A"]], fault, names // 2, *arguments
    )
    try:
        trainer.call(IpcTrainer.refit_ready).result(timeout=120)
        generation.refit_started(version, DEADLINE_S)
        outcome = trainer.call(IpcTrainer.refit_sync, version)
        with pytest.raises(RefitError) as failed:
            generation.refit_finished(version, committed=False)
        assert not outcome.done() or outcome.exception() is not None, "the trainer never committed"
        return failed.value
    finally:
        generation.close()
        trainer.close()


def test_every_worker_receives_and_refits_equal_vllms_own_load(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    assert len(_generation(engine).ipc_addresses()) == engine.tp
    refits_away_and_back(
        engine, lambda state, staged: _refit(engine, checkpoints, state, staged=staged)
    )


def test_state_that_does_not_fit_the_engine_is_refused_before_any_byte(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    checkpoints.tensors["wrong"] = {
        name: tensor[:1] if name == "model.embed_tokens.weight" else tensor
        for name, tensor in checkpoints.tensors["B"].items()
    }
    served = engine.llm.llm_engine.get_weight_version()
    generation = _generation(engine)
    with (
        _synchronizer(CheckpointPolicy(checkpoints, "wrong"), generation) as sync,
        pytest.raises(GeometryMismatchError, match=r"model\.embed_tokens\.weight"),
    ):
        sync.sync_weights(engine.next_version())
    generation.close()
    assert generate(engine.llm) == engine.expected["B'"], "the engine still serves what it had"
    assert engine.llm.llm_engine.get_weight_version() == served


@pytest.mark.parametrize(("fault", "corrupt"), FAULTS, ids=["kill", "freeze", "corrupt"])
def test_staged_refit_that_fails_mid_transfer_leaves_the_previous_weights(
    engine: Engine, checkpoints: Checkpoints, fault: str | None, corrupt: int | None
) -> None:
    served = engine.llm.llm_engine.get_weight_version()
    error = _failing(engine, checkpoints, fault, corrupt, staged=True)
    previous_weights_after(
        engine,
        error,
        served,
        lambda state, staged: _refit(engine, checkpoints, state, staged=staged),
    )


@pytest.mark.parametrize(("fault", "corrupt"), FAULTS, ids=["kill", "freeze", "corrupt"])
def test_streamed_refit_that_fails_mid_transfer_closes_the_engine_until_a_refit(
    engine: Engine, checkpoints: Checkpoints, fault: str | None, corrupt: int | None
) -> None:
    error = _failing(engine, checkpoints, fault, corrupt, staged=False)
    closed_until_a_refit(
        engine, error, lambda state, staged: _refit(engine, checkpoints, state, staged=staged)
    )


def test_a_new_controller_adopts_the_version_the_engine_serves(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    """A second generation and synchronizer (a restarted controller) over an engine serving
    version N start above N by themselves (no StaleBaseError, no version passed by hand)."""
    served = _refit(engine, checkpoints, "A")
    generation = _generation(engine)
    try:
        with _synchronizer(CheckpointPolicy(checkpoints, "B'"), generation) as sync:
            status = sync.status()
            assert set(status.serving()) == {served} and status.high_water_mark == served
            assert sync.sync_weights().version == served + 1
    finally:
        generation.close()
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
    generation = _generation(engine)
    try:
        with _synchronizer(CheckpointPolicy(checkpoints, "A"), generation) as sync:
            for _ in range(2):
                timings_add_up(
                    sync, engine.next_version(), ("connect", "begin", "stream", "commit", "load")
                )
    finally:
        generation.close()
    assert generate(engine.llm) == engine.expected["A"]
    _refit(engine, checkpoints, "B'")
