"""The in-process client drives an Engine-shaped object only through what ``sglang.Engine``
has, and refuses an engine that lacks a coroutine, a request struct or a field refit needs."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from refit_core import BackendNotInstalledError, WorkerError
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_sglang import ColocatedSGLangSynchronizer, EngineClient, UnsupportedEngineError
from refit_sglang.clients import clients_for
from refit_sglang.colocated import ROUTES as COLOCATED_ROUTES
from refit_sglang.participants import ROUTES as DISAGGREGATED_ROUTES
from sglang_engine_standin import IO_STRUCT, StandInEngine, StandInTokenizerManager
from sglang_standin import StandInSGLang

MODEL = ReferenceModelConfig()


@pytest.fixture
def engine() -> Iterator[StandInEngine]:
    created = StandInEngine(StandInSGLang(MODEL, seed=1, tp_size=2))
    try:
        yield created
    finally:
        created.shutdown()


def _served(engine: StandInEngine) -> StandInSGLang:
    manager = engine.tokenizer_manager
    assert isinstance(manager, StandInTokenizerManager)
    return manager._server


def test_every_route_is_a_tokenizer_manager_coroutine(engine: StandInEngine) -> None:
    client = EngineClient(engine, io_struct=IO_STRUCT)
    client.require({*COLOCATED_ROUTES, *DISAGGREGATED_ROUTES})
    client.call("pause_generation", {"mode": "retract"}, None)
    client.call("flush_cache", {}, None)
    client.call("continue_generation", {}, None)
    assert _served(engine).calls == [
        ("pause_generation", {"mode": "retract"}),
        ("flush_cache", {}),
        ("continue_generation", {}),
    ]
    assert client.tp_size == 2 and client.device == "cpu"


def test_a_struct_without_weight_version_is_refused(engine: StandInEngine) -> None:
    tensor_request = IO_STRUCT.UpdateWeightsFromTensorReqInput
    older = type(
        "UpdateWeightsFromTensorReqInput",
        (tensor_request,),
        {
            "__struct_fields__": tuple(
                f for f in tensor_request.__struct_fields__ if f != "weight_version"
            )
        },
    )
    structs = SimpleNamespace(**{**vars(IO_STRUCT), "UpdateWeightsFromTensorReqInput": older})
    client = EngineClient(engine, io_struct=structs)
    trainer = SimulatedTrainer(random_checkpoint(MODEL, 1), engine_dtype=MODEL.dtype)
    with pytest.raises(UnsupportedEngineError, match="has no field 'weight_version'"):
        ColocatedSGLangSynchronizer(trainer, [client])
    assert _served(engine).calls == [], "nothing may move before the check"


def test_a_manager_without_pause_is_refused(engine: StandInEngine) -> None:
    class NoPause(StandInTokenizerManager):
        pause_generation = None  # type: ignore[assignment]

    engine.tokenizer_manager = NoPause(_served(engine), engine.loop)
    client = EngineClient(engine, io_struct=IO_STRUCT)
    with pytest.raises(UnsupportedEngineError, match="no coroutine pause_generation"):
        client.require(COLOCATED_ROUTES)
    with pytest.raises(UnsupportedEngineError, match="no coroutine pause_generation"):
        client.call("pause_generation", {"mode": "abort"}, None)


def test_an_engine_without_a_tokenizer_manager_is_refused(engine: StandInEngine) -> None:
    engine.tokenizer_manager = None
    with pytest.raises(UnsupportedEngineError, match="node of rank > 0"):
        EngineClient(engine, io_struct=IO_STRUCT)


def test_a_call_from_inside_the_engine_loop_is_refused(engine: StandInEngine) -> None:
    client = EngineClient(engine, io_struct=IO_STRUCT)

    async def pause_from_inside() -> None:
        client.call("pause_generation", {"mode": "abort"}, None)

    with pytest.raises(UnsupportedEngineError, match="engine.loop is running"):
        engine.loop.run_until_complete(pause_from_inside())
    assert _served(engine).calls == []


def test_a_failed_flush_reply_is_a_worker_error(engine: StandInEngine) -> None:
    """``flush_cache`` answers a ``FlushCacheReqOutput``; its ``success=False`` is a failure."""

    def refuse(**_: object) -> None:
        raise RuntimeError("requests still running")

    _served(engine)._flush_cache = refuse  # type: ignore[method-assign]
    client = EngineClient(engine, io_struct=IO_STRUCT)
    with pytest.raises(WorkerError, match="flush_cache: RuntimeError: requests still running"):
        client.call("flush_cache", {}, None)


def test_a_failed_struct_is_a_worker_error(engine: StandInEngine) -> None:
    client = EngineClient(engine, io_struct=IO_STRUCT)
    with pytest.raises(WorkerError, match="update_weights_from_distributed: TypeError"):
        client.call("update_weights_from_distributed", {"names": ["w"]}, None)


def test_route_methods_must_take_the_version() -> None:
    class Receiver:
        server_args = SimpleNamespace(tp_size=1)

        def update_weights_from_tensor(
            self, named_tensors: list[str], load_format: str, flush_cache: bool
        ) -> tuple[bool, str]:
            return True, "loaded"

    with pytest.raises(UnsupportedEngineError, match="takes no 'weight_version'"):
        EngineClient(Receiver()).require(["update_weights_from_tensor"])
    with pytest.raises(UnsupportedEngineError, match="no method pause_generation"):
        EngineClient(Receiver()).require(["pause_generation"])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_an_engine_is_chosen_by_what_it_is(engine: StandInEngine) -> None:
    """An Engine-shaped item gets an EngineClient, which needs SGLang's request structs."""
    with pytest.raises(BackendNotInstalledError, match="io_struct"):
        clients_for([engine])
    given = EngineClient(engine, io_struct=IO_STRUCT)
    assert clients_for([given]) == [given]
