"""The Dynamo row on GPUs: workers whose vLLM receives on its own NCCL weight transfer.

One Dynamo worker (Dynamo's real runtime and RL routes, :mod:`refit_lab.dynamo_lab.worker`) of
one rank on GPU 1, or of two ranks (TP 2) on GPUs 1 and 2, whose ranks join and receive with vLLM's own worker-side code (``REFIT_LAB_RECEIVER=
vllm-nccl``: ``stateless_init_process_group``, ``packed_nccl_broadcast_consumer``, vLLM's init
and update info dataclasses); the trainer on GPU 0 hosts vLLM's ``PyNcclCommunicator``
(:mod:`refit_nccl.vllm_native`). Refits must land bitwise, and a worker whose update stalls
must leave the trainer's refit to end by the deadline naming it as possibly wedged.

Needs two CUDA GPUs (three for TP 2), a CUDA build of vLLM and ai-dynamo-runtime in the same
environment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from refit_core import RefitTimeoutError, WeightSynchronizer, create_weight_synchronizer
from refit_dynamo import DynamoRefitChannel
from refit_lab.digest import combined_digest, state_digest
from refit_lab.dynamo_lab.engine_client import RECEIVER_ENV
from refit_lab.dynamo_lab.fleet import DEFAULT_MODEL, Worker, dynamo_fleet
from refit_lab.ray_cluster import LocalCluster
from refit_lab.reference_engine import random_checkpoint
from refit_lab.trainer import SimulatedTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SEED = 21


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def gpu_worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Worker, int]]:
    """A worker of ``engine_world_size`` ranks (1, or 2 as TP 2), each rank on a GPU of its
    own, the trainer on GPU 0."""
    import torch

    ranks: int = request.param
    if torch.cuda.device_count() < 1 + ranks:
        pytest.skip(f"a trainer GPU and {ranks} worker GPUs are needed")
    pytest.importorskip("dynamo.runtime", reason="ai-dynamo-runtime is not installed")
    pytest.importorskip("vllm", reason="vLLM's NCCL weight transfer needs vLLM")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("the installed vLLM is not a CUDA build")
    torch.cuda.set_device(0)
    visible = ",".join(str(gpu) for gpu in range(1, 1 + ranks))
    env = {RECEIVER_ENV: "vllm-nccl", "CUDA_VISIBLE_DEVICES": visible}
    with dynamo_fleet(1, SEED, tmp_path_factory.mktemp("dynamo-gpu"), env=env) as ready:
        (worker,) = ready()
        worker.configure(ranks)
        yield worker, ranks


def _synchronizer(
    trainer: SimulatedTrainer, worker: Worker, ranks: int, timeout_s: float
) -> WeightSynchronizer:
    channel = DynamoRefitChannel(
        [worker.endpoint], engine_world_size=ranks, control_timeout_s=60.0, device="cuda"
    )
    return create_weight_synchronizer(
        trainer,
        channel,
        "dynamo",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_timeout_s=timeout_s,
    )


def test_refits_land_bitwise_and_a_stalled_worker_is_named_by_the_deadline(
    gpu_worker: tuple[Worker, int],
) -> None:
    worker, ranks = gpu_worker
    trainer = SimulatedTrainer(random_checkpoint(DEFAULT_MODEL, SEED + 1))
    synchronizer = _synchronizer(trainer, worker, ranks, 30.0)
    try:
        for version in (1, 2):
            trainer.step(lr=1e-2)
            assert synchronizer.sync_weights().version == version
            expected = combined_digest(state_digest(trainer.engine_state().items()))
            assert [r["digest"] for r in worker.state()["ranks"]] == [expected] * ranks
        assert getattr(synchronizer, "backend", None) == "nccl"
    finally:
        synchronizer.shutdown()

    trainer.step(lr=1e-2)
    stalled = _synchronizer(trainer, worker, ranks, 4.0)
    try:
        stalled.init_communicator()
        worker.set_faults(update_weights={"delay_s": 20.0})
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError) as caught:
            stalled.sync_weights()
        assert time.monotonic() - started <= 4.0 + 5.0 + 2.0  # deadline + grace + slack
        assert worker.endpoint.instance_id in caught.value.wedged_workers
    finally:
        stalled.shutdown()
