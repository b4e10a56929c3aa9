"""The colocated row against stand-in SGLang engines, over HTTP and in process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from refit_core import EngineState, RefitTimeoutError, WorkerError, create_weight_synchronizer
from refit_lab.conformance import RefitDeployment, SynchronizerConformance, check_bitwise_delivery
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_sglang import ColocatedOptions, ColocatedSGLangSynchronizer, EngineClient, HttpClient
from refit_sglang.protocol import REFIT_FIELDS
from sglang_engine_standin import IO_STRUCT, StandInEngine
from sglang_standin import StandInDeployment, StandInSGLang, serve

pytestmark = pytest.mark.timeout(60)

MODEL = ReferenceModelConfig()
KiB = 1024


def _deploy(
    *,
    tp_sizes: Sequence[int] = (1, 2),
    http: bool = True,
    config: ReferenceModelConfig = MODEL,
    bucket_size_bytes: int = 64 * KiB,
    refit_timeout_s: float | None = None,
) -> StandInDeployment:
    trainer = SimulatedTrainer(random_checkpoint(config, 1), engine_dtype=config.dtype, lr=1e-2)
    engines = [StandInSGLang(config, seed=2 + i, tp_size=tp) for i, tp in enumerate(tp_sizes)]
    stack = contextlib.ExitStack()
    clients = [
        HttpClient(stack.enter_context(serve(e)), control_timeout_s=10.0)
        if http
        else _in_process(e, f"engine {i}", stack)
        for i, e in enumerate(engines)
    ]
    try:
        synchronizer = ColocatedSGLangSynchronizer(
            trainer,
            clients,
            refit_timeout_s=refit_timeout_s,
            options=ColocatedOptions(bucket_size_bytes=bucket_size_bytes),
        )
    except BaseException:
        stack.close()
        raise
    return StandInDeployment(trainer, synchronizer, config, engines, stack)


def _in_process(server: StandInSGLang, label: str, stack: contextlib.ExitStack) -> EngineClient:
    engine = StandInEngine(server)
    stack.callback(engine.shutdown)
    return EngineClient(engine, label, io_struct=IO_STRUCT)


class TestColocatedHttp(SynchronizerConformance):
    """Two HTTP engines (1 and 2 ranks), bf16."""

    def create_deployment(self) -> RefitDeployment:
        return _deploy()


class TestColocatedInProcess(SynchronizerConformance):
    """Two in-process Engine-like objects (1 and 2 ranks), fp32."""

    def create_deployment(self) -> RefitDeployment:
        return _deploy(http=False, config=ReferenceModelConfig(dtype="float32"))


@pytest.fixture(params=["http", "in_process"])
def deployment(request: pytest.FixtureRequest) -> Iterator[StandInDeployment]:
    created = _deploy(http=request.param == "http")
    try:
        yield created
    finally:
        created.close()


def _shared_files() -> set[Path]:
    """This process's shared-memory segments (torch's file-system strategy names them)."""
    return set(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))


def test_lifecycle_around_every_refit(deployment: StandInDeployment) -> None:
    deployment.synchronizer.sync_weights()
    for engine in deployment.engines:
        routes = [route for route, _ in engine.calls]
        assert routes[0] == "pause_generation" and routes[-2:] == [
            "flush_cache",
            "continue_generation",
        ]
        updates = [body for route, body in engine.calls if route == "update_weights_from_tensor"]
        assert len(updates) > 1, "the small bucket size should split the state"
        assert all(b["load_format"] == "flattened_bucket" for b in updates)
        assert [b.get("weight_version") for b in updates] == [None] * (len(updates) - 1) + ["1"]
        assert {route: body["mode"] for route, body in engine.calls[:1]} == {
            "pause_generation": "abort"
        }
        assert all(
            set(body) <= {*REFIT_FIELDS[route], "serialized_named_tensors"}
            for route, body in engine.calls
        )
        assert engine.weight_version == "1" and not engine.paused


def test_bucket_memory_released(deployment: StandInDeployment) -> None:
    before = _shared_files()
    deployment.trainer.step()
    result = deployment.synchronizer.sync_weights()
    buffers = deployment.synchronizer.source.buffers  # type: ignore[attr-defined]
    assert buffers.live_bytes == 0
    assert 0 < buffers.peak_bytes <= 64 * KiB < result.dense_bytes
    assert _shared_files() <= before


def _refuse_loads(engine: StandInSGLang) -> Callable[[], None]:
    """Make every rank of ``engine`` fail to load; returns what undoes it."""
    originals = [rank.load_weights for rank in engine.ranks]

    def refuse(weights: object) -> set[str]:
        raise RuntimeError("out of memory")

    for rank in engine.ranks:
        rank.load_weights = refuse  # type: ignore[method-assign]

    def undo() -> None:
        for rank, original in zip(engine.ranks, originals, strict=True):
            rank.load_weights = original  # type: ignore[method-assign]

    return undo


def test_a_failed_refit_reports_each_engine_and_closes_the_mixed(
    deployment: StandInDeployment,
) -> None:
    """Engine 0 takes bucket 0, engine 1 refuses it: both may hold mixed weights, so both
    stay paused (closed) and are reported so; the next complete refit reopens them."""
    undo = _refuse_loads(deployment.engines[1])
    with pytest.raises(WorkerError, match="update_weights_from_tensor") as caught:
        deployment.synchronizer.sync_weights()
    labels = [c.label for c in deployment.synchronizer.clients]  # type: ignore[attr-defined]
    assert caught.value.states() == {labels[0]: EngineState.CLOSED, labels[1]: EngineState.CLOSED}
    assert caught.value.failed_shards == (0, 1)
    assert "out of memory" in (caught.value.engines[1].reason or "")
    assert all(engine.paused for engine in deployment.engines)
    assert deployment.synchronizer.source.buffers.live_bytes == 0  # type: ignore[attr-defined]
    undo()
    deployment.synchronizer.sync_weights()
    assert not any(engine.paused for engine in deployment.engines)
    check_bitwise_delivery(deployment)


def test_an_engine_that_took_nothing_keeps_serving_its_version(
    deployment: StandInDeployment,
) -> None:
    """Engine 0 refuses the first bucket: engine 1 took nothing, serves version 0 and
    continues generation; engine 0 is closed."""
    _refuse_loads(deployment.engines[0])
    with pytest.raises(WorkerError) as caught:
        deployment.synchronizer.sync_weights()
    (engine0, engine1) = caught.value.engines
    assert (engine0.state, engine0.shard) == (EngineState.CLOSED, 0)
    assert (engine1.state, engine1.version, engine1.reason) == (EngineState.OLD, 0, None)
    assert deployment.engines[0].paused and not deployment.engines[1].paused


def test_deadline_names_the_wedged_engine() -> None:
    created = _deploy(refit_timeout_s=1.0)
    try:
        frozen = created.engines[1]
        frozen.hang_on, frozen.hang_s = "update_weights_from_tensor", 3.0
        with pytest.raises(RefitTimeoutError) as caught:
            created.synchronizer.sync_weights()
        synchronizer = created.synchronizer
        assert isinstance(synchronizer, ColocatedSGLangSynchronizer)
        assert caught.value.wedged_workers == (synchronizer.clients[1].label,)
        assert caught.value.states()[synchronizer.clients[1].label] == EngineState.UNKNOWN
        # engine 0 took the first bucket before engine 1 froze on it: mixed, kept paused
        assert caught.value.states()[synchronizer.clients[0].label] == EngineState.CLOSED
        assert created.engines[0].paused
    finally:
        created.close()


def test_deadline_refused_for_in_process_engines() -> None:
    with pytest.raises(ValueError, match="cannot be enforced"):
        _deploy(http=False, refit_timeout_s=5.0)


def test_in_place_pause_refused() -> None:
    with pytest.raises(ValueError, match="in_place"):
        ColocatedOptions(pause_mode="in_place")  # type: ignore[arg-type]


def test_factory_row() -> None:
    config = MODEL
    trainer = SimulatedTrainer(random_checkpoint(config, 1), engine_dtype=config.dtype)
    engines = [StandInSGLang(config, seed=5, tp_size=tp) for tp in (1, 2)]
    with serve(engines[0]) as url, contextlib.ExitStack() as stack:
        synchronizer = create_weight_synchronizer(
            trainer,
            [url, _in_process(engines[1], "engine 1", stack)],
            "sglang",
            colocated=True,
            refit_buffer_size_gb=1 / 4096,
        )
        deployment = StandInDeployment(trainer, synchronizer, config, engines)
        try:
            assert isinstance(synchronizer, ColocatedSGLangSynchronizer)
            check_bitwise_delivery(deployment)
        finally:
            deployment.close()


def test_options_of_the_wrong_type_are_refused_when_built() -> None:
    with pytest.raises(TypeError, match=r"ColocatedOptions.control_timeout_s takes float"):
        ColocatedOptions(control_timeout_s=None)  # type: ignore[arg-type]
