"""The channel and the factory row against real Dynamo system servers (``ai-dynamo-runtime``),
one per worker process, serving the RL admin routes over reference engines that join the
trainer's gloo group (see :mod:`refit_lab.dynamo_lab.worker`). Runs in definition order: the
factory row needs no Ray and runs first; the deadline test, which leaves a worker busy, runs
last."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from refit_core import (
    RefitTimeoutError,
    WeightSynchronizer,
    create_weight_synchronizer,
)
from refit_dynamo import (
    AdminClient,
    DynamoFleetError,
    DynamoRefitChannel,
    DynamoWorkerError,
    DynamoWorkerTimeoutError,
)
from refit_lab.digest import combined_digest, state_digest
from refit_lab.dynamo_lab.fleet import DEFAULT_MODEL, Worker, bare_worker, dynamo_fleet
from refit_lab.ray_cluster import LocalCluster, free_port, local_ray
from refit_lab.reference_engine import random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl.backend import GroupSpec, JoinRequest, VllmPeerTrainer

pytestmark = pytest.mark.timeout(120)

# Dynamo's runtime and Ray are test tools of the workspace's dev group, not refit-dynamo
# dependencies: an environment holding only refit-dynamo (scripts/test-isolated) skips this module.
pytest.importorskip("dynamo.runtime", reason="ai-dynamo-runtime (dev group) is not installed")
pytest.importorskip("ray", reason="ray (dev group) is not installed")

MiB = 1024 * 1024
MODEL = DEFAULT_MODEL
"""The workers' model."""
SEED = 11
CONTROL_S = 3.0
REFIT_CONTROL_S = 30.0
SLACK_S = 2.0
"""Allowance for a loaded 2-core machine on top of a timeout."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    """Two Dynamo workers."""
    with dynamo_fleet(2, SEED, tmp_path_factory.mktemp("dynamo")) as ready:
        yield ready()


@pytest.fixture(scope="module")
def ray_session(fleet: list[Worker]) -> Iterator[None]:
    """Ray, for the channel's ref API (started once the workers are up: the machine is small);
    a Ray another test module left running is reused."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():
        yield
        return
    with local_ray(num_cpus=2, object_store_memory=80 * MiB, log_to_driver=False):
        yield


@pytest.fixture
def pair(fleet: list[Worker]) -> list[Worker]:
    """The two workers without faults and with empty call logs."""
    for worker in fleet:
        worker.set_faults()
    return fleet


def channel_over(
    workers: list[Worker], control_timeout_s: float = CONTROL_S, engine_world_size: int = 1
) -> DynamoRefitChannel:
    endpoints = [w.endpoint for w in workers]
    return DynamoRefitChannel(
        endpoints,
        engine_world_size=engine_world_size,
        control_timeout_s=control_timeout_s,
        validate_workers=lambda: endpoints,
        device="cpu",  # the stand-in workers receive over gloo
    )


def expected_digest(trainer: SimulatedTrainer) -> str:
    return combined_digest(state_digest(trainer.engine_state().items()))


def rank_digests(workers: list[Worker]) -> list[str]:
    return [rank["digest"] for w in workers for rank in w.state()["ranks"]]


def declared_versions(workers: list[Worker]) -> list[object]:
    """The weight version each worker's Dynamo handler has declared."""
    client = AdminClient(CONTROL_S)
    return [client.post(w.endpoint, "get_weight_version", {})["version"] for w in workers]


# -- admin calls and cache flush ---------------------------------------------------------


def test_flush_cache_pauses_clears_and_resumes_every_worker(pair: list[Worker]) -> None:
    assert channel_over(pair).flush_cache() is True
    for worker in pair:
        state = worker.state()
        assert state["calls"] == ["pause_generation", "reset_prefix_cache", "resume_generation"]
        assert state["paused"] is False


def test_failed_pause_resumes_only_the_paused_and_raises_one_error(pair: list[Worker]) -> None:
    pair[1].set_faults(pause_generation={"fail": "engine busy"})
    with pytest.raises(DynamoFleetError) as caught:
        channel_over(pair).flush_cache()
    error = caught.value
    assert error.failed_workers == ("worker-1",)
    (failure,) = error.failures
    assert (failure.instance_id, failure.route) == ("worker-1", "pause_generation")
    assert "engine busy" in str(error) and "1 of 2 workers failed" in str(error)
    assert pair[0].state()["calls"][-1] == "resume_generation"
    assert pair[1].state()["calls"] == ["pause_generation"]


def test_failed_resume_is_reported_with_the_failed_pause(pair: list[Worker]) -> None:
    pair[0].set_faults(resume_generation={"fail": "stuck"})
    pair[1].set_faults(pause_generation={"fail": "busy"})
    with pytest.raises(DynamoFleetError) as caught:
        channel_over(pair).flush_cache()
    assert [(f.instance_id, f.route) for f in caught.value.failures] == [
        ("worker-1", "pause_generation"),
        ("worker-0", "resume_generation"),
    ]


def test_non_ok_status_is_a_typed_error(pair: list[Worker]) -> None:
    client = AdminClient(CONTROL_S)
    body = {"engine_rpc": "update_weights", "allow_unpaused": True, "reset_prefix_cache": True}
    with pytest.raises(DynamoWorkerError) as caught:
        client.post(pair[0].endpoint, "update_weights_from_distributed", body, rpc="update_weights")
    error = caught.value
    assert (error.instance_id, error.route, error.status_code) == (
        "worker-0",
        "update_weights_from_distributed",
        200,
    )
    assert "status 'error'" in str(error) and "cannot reset the prefix cache" in str(error)
    assert not isinstance(error, DynamoWorkerTimeoutError)


def test_http_errors_are_typed(pair: list[Worker]) -> None:
    client = AdminClient(CONTROL_S)
    with pytest.raises(DynamoWorkerError) as missing:
        client.post(pair[0].endpoint, "no_such_route", {})
    assert missing.value.status_code == 404 and "Route not found" in str(missing.value)
    with pytest.raises(DynamoWorkerError) as crashed:
        client.post(pair[0].endpoint, "_test/configure", {})
    assert crashed.value.status_code == 500 and "KeyError" in str(crashed.value)


def test_slow_worker_times_out_within_the_control_timeout(pair: list[Worker]) -> None:
    pair[1].set_faults(pause_generation={"delay_s": CONTROL_S + 5})
    started = time.monotonic()
    with pytest.raises(DynamoFleetError) as caught:
        channel_over(pair).flush_cache()
    elapsed = time.monotonic() - started
    (failure,) = caught.value.failures
    assert isinstance(failure, DynamoWorkerTimeoutError)
    assert failure.instance_id == "worker-1" and failure.route == "pause_generation"
    assert CONTROL_S <= elapsed < CONTROL_S + SLACK_S


def test_worker_down_is_a_typed_error_within_the_control_timeout(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    client = AdminClient(CONTROL_S)
    with bare_worker(tmp_path_factory.mktemp("bare")) as ready:
        (victim,) = ready()
        with pytest.raises(DynamoWorkerError, match="HTTP 404"):
            client.post(victim.endpoint, "pause_generation", {})
        victim.process.kill()
        victim.process.wait(timeout=30)
        started = time.monotonic()
        with pytest.raises(DynamoWorkerError) as caught:
            client.post(victim.endpoint, "pause_generation", {"mode": "wait", "clear_cache": True})
    assert time.monotonic() - started < CONTROL_S
    error = caught.value
    assert (error.instance_id, error.route, error.status_code) == (
        "worker-0",
        "pause_generation",
        None,
    )
    assert "unreachable" in str(error) and error.is_retryable


def test_connections_are_pooled(pair: list[Worker]) -> None:
    client = AdminClient(CONTROL_S)
    client.post(pair[0].endpoint, "flush_cache", {})
    pool = client._session()._transport._pool  # type: ignore[attr-defined]
    first = list(pool.connections)
    client.post(pair[0].endpoint, "flush_cache", {})
    assert list(pool.connections) == first and len(first) == 1
    client.close()


# -- the factory row ---------------------------------------------------------------------


def make_synchronizer(
    trainer: SimulatedTrainer, channel: DynamoRefitChannel, timeout_s: float
) -> WeightSynchronizer:
    return create_weight_synchronizer(
        trainer,
        channel,
        "dynamo",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(len(channel.workers)),
        refit_timeout_s=timeout_s,
    )


@pytest.mark.parametrize("engine_world_size", [1, 2])
def test_factory_refit_is_bitwise_on_every_rank(pair: list[Worker], engine_world_size: int) -> None:
    for worker in pair:
        worker.configure(engine_world_size)
    trainer = SimulatedTrainer(random_checkpoint(MODEL, SEED + 2))
    channel = channel_over(pair, REFIT_CONTROL_S, engine_world_size)
    with make_synchronizer(trainer, channel, 20.0) as synchronizer:
        for version in (1, 2):
            trainer.step(lr=1e-2)
            result = synchronizer.sync_weights()
            assert result.version == version and result.ok
            assert rank_digests(pair) == [expected_digest(trainer)] * 2 * engine_world_size
            assert declared_versions(pair) == [version] * 2
        states = [w.state() for w in pair]
    assert all(r["updates"] == 2 for s in states for r in s["ranks"])
    assert all(
        s["calls"][-3:] == ["pause_generation", "reset_prefix_cache", "resume_generation"]
        for s in states
    )


# -- Ray --------------------------------------------------------------------------------


def _flush_remotely(channel: DynamoRefitChannel) -> bool:
    return channel.flush_cache()


@pytest.mark.usefixtures("ray_session")
def test_client_copy_works_in_a_ray_task(pair: list[Worker]) -> None:
    import ray

    copy = channel_over(pair).client_copy()
    assert ray.get(ray.remote(num_cpus=0)(_flush_remotely).remote(copy), timeout=60) is True
    assert all(w.state()["calls"][-1] == "resume_generation" for w in pair)


@pytest.mark.usefixtures("ray_session")
def test_channel_refs_run_join_and_update_beside_the_trainer(pair: list[Worker]) -> None:
    """The NeMo-RL-style surface: init_collective / update_weights refs while rank 0 sends."""
    import ray

    for worker in pair:
        worker.configure(1)
    trainer_state = SimulatedTrainer(random_checkpoint(MODEL, SEED + 1))
    sender = VllmPeerTrainer(trainer_state)
    channel = channel_over(pair, REFIT_CONTROL_S)
    info = dict(sender.refit_state())
    channel.prepare(info)
    port, world = free_port(), 1 + channel.inference_world_size
    request = JoinRequest(
        GroupSpec("127.0.0.1", port, 0, world, "gloo", "nemo-style"),
        tuple(info.items()),
        channel.sender_spec,
        60.0,
    )
    run_beside(
        lambda: sender.refit_join(request),
        channel.init_collective("127.0.0.1", port, world, train_world_size=1),
    )
    trainer_state.step(lr=1e-2)
    refs = channel.update_weights(weight_version=1)
    run_beside(lambda: sender.refit_transfer(1, 60.0), refs)
    assert ray.get(refs, timeout=60) == ["worker-0", "worker-1"]
    assert rank_digests(pair) == [expected_digest(trainer_state)] * 2
    assert declared_versions(pair) == [1, 1]
    calls = pair[0].state()["calls"]
    assert calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert channel.flush_cache() is True
    sender.refit_abort("test done")


def run_beside(trainer_side: Any, refs: list[Any]) -> None:
    """Run ``trainer_side`` on a thread while ``refs`` complete; raise what either raised."""
    import ray

    errors: list[BaseException] = []

    def target() -> None:
        try:
            trainer_side()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    ray.get(refs, timeout=90)
    thread.join(90)
    assert not thread.is_alive() and not errors, errors


def test_refit_past_its_deadline_names_the_wedged_worker(pair: list[Worker]) -> None:
    """Worker 1's engine stalls inside its update: the trainer side still returns by the
    deadline (plus the synchronizer's grace) and names worker 1 as possibly wedged."""
    for worker in pair:
        worker.configure(1)
    trainer = SimulatedTrainer(random_checkpoint(MODEL, SEED + 3))
    channel = channel_over(pair, REFIT_CONTROL_S)
    deadline_s = 4.0
    with make_synchronizer(trainer, channel, deadline_s) as synchronizer:
        synchronizer.init_communicator()
        pair[1].set_faults(update_weights={"delay_s": 20.0})
        trainer.step(lr=1e-2)
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError) as caught:
            synchronizer.sync_weights()
        elapsed = time.monotonic() - started
    assert caught.value.wedged_workers == ("worker-1",)
    assert "failed on worker-1: no answer (wedged or dead)" in str(caught.value)
    assert elapsed < deadline_s + 5.0 + SLACK_S
