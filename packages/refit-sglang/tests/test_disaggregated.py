"""The non-colocated row: stand-in SGLang servers join the trainer's gloo group."""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Sequence

import pytest

from refit_core import EngineState, RefitError, WeightSynchronizer, create_weight_synchronizer
from refit_lab.conformance import RefitDeployment, SynchronizerConformance, check_bitwise_delivery
from refit_lab.faults import ProcessGang
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl import CollectiveWeightSynchronizer
from refit_sglang import EngineClient, HttpClient, SGLangClient, SGLangCollectiveSynchronizer
from refit_sglang.protocol import REFIT_FIELDS
from sglang_engine_standin import IO_STRUCT, StandInEngine
from sglang_standin import StandInDeployment, StandInSGLang, serve, serve_in_process

pytestmark = pytest.mark.timeout(90)

MODEL = ReferenceModelConfig(vocab_size=8192)
"""Embedding and head of 1 MiB each, so a 1 MiB bucket size makes several calls per refit."""
BUCKET_GB = 1 / 1024


def _synchronizer(
    trainer: SimulatedTrainer,
    urls: Sequence[str | SGLangClient],
    refit_timeout_s: float | None = 30.0,
) -> WeightSynchronizer:
    return create_weight_synchronizer(
        trainer,
        list(urls),
        "sglang",
        colocated=False,
        refit_buffer_size_gb=BUCKET_GB,
        refit_timeout_s=refit_timeout_s,
    )


def _deploy(tp_sizes: Sequence[int] = (1, 2), *, http: bool = True) -> StandInDeployment:
    trainer = SimulatedTrainer(random_checkpoint(MODEL, 1), engine_dtype=MODEL.dtype, lr=1e-2)
    engines = [StandInSGLang(MODEL, seed=2 + i, tp_size=tp) for i, tp in enumerate(tp_sizes)]
    stack = contextlib.ExitStack()
    if http:
        synchronizer = _synchronizer(trainer, [stack.enter_context(serve(e)) for e in engines])
    else:
        in_process = [StandInEngine(e) for e in engines]
        for engine in in_process:
            stack.callback(engine.shutdown)
        clients: list[str | SGLangClient] = [
            EngineClient(e, f"engine {i}", io_struct=IO_STRUCT) for i, e in enumerate(in_process)
        ]
        synchronizer = _synchronizer(trainer, clients, refit_timeout_s=None)
    return StandInDeployment(trainer, synchronizer, MODEL, engines, stack)


class TestDisaggregated(SynchronizerConformance):
    """Two HTTP engines (1 and 2 ranks) in one group of 4 ranks."""

    def create_deployment(self) -> RefitDeployment:
        return _deploy()


class TestDisaggregatedInProcess(SynchronizerConformance):
    """Two in-process Engine-shaped objects (1 and 2 ranks): their calls run on the
    participants' threads, on each engine's own loop."""

    def create_deployment(self) -> RefitDeployment:
        return _deploy(http=False)


@pytest.mark.parametrize("http", [True, False], ids=["http", "in_process"])
def test_calls_and_group_lifecycle(http: bool) -> None:
    deployment = _deploy(http=http)
    try:
        assert isinstance(deployment.synchronizer, CollectiveWeightSynchronizer)
        deployment.synchronizer.sync_weights()
        for engine in deployment.engines:
            routes = [route for route, _ in engine.calls]
            assert routes[0] == "init_weights_update_group"
            init = engine.calls[0][1]
            assert init["world_size"] == 4 and init["backend"] == "gloo"
            assert routes[1] == "pause_generation" and routes[-2:] == [
                "flush_cache",
                "continue_generation",
            ]
            updates = [b for r, b in engine.calls if r == "update_weights_from_distributed"]
            assert len(updates) > 1
            assert updates[-1]["weight_version"] == "1"
            assert all(set(body) <= set(REFIT_FIELDS[route]) for route, body in engine.calls)
        assert [c[1]["rank_offset"] for e in deployment.engines for c in e.calls[:1]] == [1, 2]
        deployment.synchronizer.shutdown()
        for engine in deployment.engines:
            assert engine.calls[-1][0] == "destroy_weights_update_group" and not engine.groups
    finally:
        deployment.close()


def test_shutdown_closes_the_clients() -> None:
    """The builder's HTTP clients are closed by shutdown, and nothing warns of a leak."""
    deployment = _deploy()
    try:
        synchronizer = deployment.synchronizer
        assert isinstance(synchronizer, SGLangCollectiveSynchronizer)
        clients = synchronizer.clients
        assert all(isinstance(c, HttpClient) and not c.closed for c in clients)
        synchronizer.sync_weights()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            synchronizer.shutdown()
            gc.collect()
        assert all(isinstance(c, HttpClient) and c.closed for c in clients)
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        deployment.close()


@pytest.mark.slow
def test_engine_killed_mid_refit() -> None:
    """An engine SIGKILLs itself on its first update call: the refit fails by the deadline
    naming it; the survivor, which took part in the broadcast, stays paused (closed: it may hold
    part of the new weights) and says so in the error; a rebuild over the survivor refits it
    completely and only then does it continue generation."""
    trainer = SimulatedTrainer(random_checkpoint(MODEL, 1), engine_dtype=MODEL.dtype, lr=1e-2)
    survivor = StandInSGLang(MODEL, seed=2, collective_timeout_s=8.0)
    with ProcessGang() as gang, serve(survivor) as url:
        gang.spawn(serve_in_process, MODEL, 3, 1, "update_weights_from_distributed", gang.results)
        (doomed,) = gang.collect(1, timeout_s=60)
        synchronizer = _synchronizer(trainer, [url, doomed], refit_timeout_s=4.0)
        try:
            trainer.step()
            started = time.monotonic()
            with pytest.raises(RefitError, match=doomed) as caught:
                synchronizer.sync_weights()
            assert time.monotonic() - started < 4.0 + 8.0
            assert "refit to version 1" in str(caught.value)
            assert synchronizer.is_stale()
            states = caught.value.states()
            assert states[url] in (EngineState.CLOSED, EngineState.UNKNOWN), states
            # The survivor's own update ends by its collective timeout; it must not resume.
            time.sleep(8.0 + 1.0)
            assert survivor.paused, "an engine that may hold mixed weights resumed generation"
            assert "continue_generation" not in [route for route, _ in survivor.calls]
            synchronizer.reconcile_communicator([1])
            deployment = StandInDeployment(trainer, synchronizer, MODEL, [survivor])
            check_bitwise_delivery(deployment)
            assert not survivor.paused, "a complete refit did not resume the survivor"
        finally:
            synchronizer.shutdown()
