"""The colocated row fed by trainer ranks running as Ray actors: each bucket is gathered from
the ranks' shards to the root rank, which hands its handle to the stand-in engines."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from refit_core import EngineState, RefitTimeoutError, WorkerError  # noqa: E402
from refit_lab.conformance import (  # noqa: E402
    check_bitwise_delivery,
    check_generation_matches_trainer,
)
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint  # noqa: E402
from refit_lab.trainer import SimulatedTrainer  # noqa: E402
from refit_sglang import (  # noqa: E402
    ColocatedOptions,
    ColocatedSGLangSynchronizer,
    HttpClient,
    RayTrainerRanks,
)
from sglang_standin import StandInDeployment, StandInSGLang, serve  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MODEL = ReferenceModelConfig()
KiB, MiB = 1024, 1 << 20
BUCKET = 32 * KiB
RANKS = 2


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import rank_actors
    from refit_lab.ray_cluster import local_ray

    with pytest.MonkeyPatch.context() as patch:
        # a shared test machine: other users' memory must not get these workers OOM-killed
        patch.setenv("RAY_memory_monitor_refresh_ms", "0")
        options = {"object_store_memory": 80 * MiB, "log_to_driver": False}
        with local_ray(num_cpus=4, by_value=[rank_actors], **options):
            yield


class _Mirror(SimulatedTrainer):
    """The trainer the checks compare with; every step also steps the Ray ranks."""

    def __init__(self, ranks: list[Any]) -> None:
        super().__init__(random_checkpoint(MODEL, 1), engine_dtype=MODEL.dtype, lr=1e-2)
        self.ranks = ranks

    def step(self, lr: float | None = None) -> None:
        super().step(lr)
        ray.get([r.step.remote() for r in self.ranks], timeout=60)


@contextlib.contextmanager
def _deploy(refit_timeout_s: float | None = None) -> Iterator[StandInDeployment]:
    from rank_actors import ShardRank

    actor = ray.remote(ShardRank).options(num_cpus=0, max_restarts=0)
    ranks = [actor.remote(MODEL, rank, RANKS) for rank in range(RANKS)]
    # started before any timed call (starting a torch process takes long on a loaded machine)
    ray.get([r.refit_memory.remote() for r in ranks], timeout=180)
    engines = [StandInSGLang(MODEL, seed=2 + i, tp_size=tp) for i, tp in enumerate((1, 2))]
    stack = contextlib.ExitStack()
    clients = [HttpClient(stack.enter_context(serve(e)), control_timeout_s=30.0) for e in engines]
    synchronizer = ColocatedSGLangSynchronizer(
        RayTrainerRanks(ranks, control_timeout_s=30.0),
        clients,
        refit_timeout_s=refit_timeout_s,
        options=ColocatedOptions(bucket_size_bytes=BUCKET),
    )
    deployment = StandInDeployment(_Mirror(ranks), synchronizer, MODEL, engines, stack)
    try:
        yield deployment
    finally:
        deployment.close()
        for rank in ranks:
            ray.kill(rank, no_restart=True)


def test_bitwise_greedy_and_bounded_memory(ray_session: None) -> None:
    with _deploy() as deployment:
        check_bitwise_delivery(deployment)
        check_generation_matches_trainer(deployment)
        root = deployment.trainer.ranks[0]  # type: ignore[attr-defined]
        live, peak = ray.get(root.refit_memory.remote(), timeout=30)
        sizes = [t.nbytes for t in deployment.trainer.engine_state().values()]
        assert live == 0, "the root kept a bucket buffer after the refit"
        assert 0 < peak <= max(BUCKET, *sizes) < sum(sizes) / 4, (peak, sizes)
        for engine in deployment.engines:
            updates = [b for r, b in engine.calls if r == "update_weights_from_tensor"]
            assert len(updates) > 4 and updates[-1]["weight_version"] == "2"


@pytest.mark.parametrize("kind", ["die", "freeze"])
def test_lost_rank_fails_by_the_deadline(ray_session: None, kind: str) -> None:
    with _deploy(refit_timeout_s=3.0) as deployment:
        ranks = deployment.trainer.ranks  # type: ignore[attr-defined]
        ray.get(ranks[1].fault.remote(kind, 1), timeout=30)
        expected = WorkerError if kind == "die" else RefitTimeoutError
        started = time.monotonic()
        with pytest.raises(expected) as caught:
            deployment.synchronizer.sync_weights()
        assert time.monotonic() - started < 3.0 + 2.0
        assert "trainer rank 1" in str(caught.value)
        states = caught.value.states()
        assert set(states.values()) <= {EngineState.OLD, EngineState.CLOSED}
        clients = deployment.synchronizer.clients  # type: ignore[attr-defined]
        for client, engine in zip(clients, deployment.engines, strict=True):
            closed = states[client.label] == EngineState.CLOSED  # took part of the weights
            assert engine.paused == closed and engine.weight_version is None
            if not closed:
                assert engine.calls[-1][0] == "continue_generation"
