"""refit-nccl's calls into a vLLM worker: built from the engine role's calls, carried as bytes,
run by the worker's one dispatcher on the typed method they name (the worker itself, under a
real vLLM engine, is tested by the engine tier: ``tests/engine/test_collective.py``)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from refit_core import ProtocolError, WorkerError
from refit_core.backend import (
    CollectiveSenderSpec,
    WorkerCall,
    WorkerReply,
    answer,
    encode,
    reply_from_bytes,
    role_methods,
)
from refit_nccl.group.spec import GroupSpec
from refit_nccl.roles.contract import (
    CollectiveStagingRole,
    CommitStats,
    JoinRequest,
    WorkerRefitStatus,
)
from refit_nccl.transfer.stats import TransferStats
from refit_nccl.vllm.calls import (
    Abort,
    Commit,
    CommitStaged,
    DropStaged,
    EngineCall,
    Join,
    Plan,
    Staging,
    Status,
    Transfer,
    engine_call,
)

SPEC = CollectiveSenderSpec("refit", 1 << 20, 2)
STATS = TransferStats(3, 300, 290, 0.1, 0.2, 0.3, 0.6)
STATUS = WorkerRefitStatus(4, 4, dirty=False, connected=True, abort_cause=None)


@dataclass
class _Endpoint:
    """The endpoint half of the worker role, recording what it was asked."""

    asked: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def refit_device(self) -> Any:
        raise AssertionError("not called here")

    def refit_plan(self, state: Any, geometry: CollectiveSenderSpec) -> str:
        self.asked.append(("refit_plan", (state, geometry)))
        return "plan-digest"

    def refit_join(self, request: JoinRequest) -> str:
        self.asked.append(("refit_join", (request,)))
        return "join-digest"

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        raise AssertionError("a vLLM worker transfers inside its update session")

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        self.asked.append(("refit_abort", (cause, group_name)))

    def refit_geometry(self) -> CollectiveSenderSpec:
        return SPEC

    def refit_commit(self, version: int) -> int:
        raise AssertionError("a vLLM worker commits through its role")

    def refit_status(self) -> WorkerRefitStatus:
        raise AssertionError("a vLLM worker reports its status through its role")


class _Worker:
    """A :class:`~refit_nccl.vllm.calls.VllmWorkerRole` recording the typed methods run."""

    def __init__(self) -> None:
        self.endpoint = _Endpoint()
        self.asked = self.endpoint.asked

    def transfer(self, version: int, timeout_s: float | None) -> TransferStats | None:
        self.asked.append(("transfer", (version, timeout_s)))
        return STATS

    def stage(self, version: int, timeout_s: float | None) -> None:
        self.asked.append(("stage", (version, timeout_s)))

    def staging(self) -> TransferStats | None:
        self.asked.append(("staging", ()))
        return None

    def commit(self, version: int) -> int:
        self.asked.append(("commit", (version,)))
        return version

    def commit_staged(self, version: int) -> CommitStats:
        self.asked.append(("commit_staged", (version,)))
        return CommitStats(version, 0.5)

    def drop_staged(self) -> None:
        self.asked.append(("drop_staged", ()))

    def status(self) -> WorkerRefitStatus:
        self.asked.append(("status", ()))
        return STATUS


def _round_trip(call: WorkerCall[Any, Any], worker: _Worker) -> WorkerReply[Any]:
    """``call`` as the controller sends it, answered as the worker extension answers it."""
    return _round_trip_bytes(encode(call), worker)


JOIN = JoinRequest(GroupSpec("127.0.0.1", 29500, 1, 2), (), SPEC, 5.0)
CASES = [
    (Plan((), SPEC), ("refit_plan", ((), SPEC)), "plan-digest"),
    (Join(JOIN), ("refit_join", (JOIN,)), "join-digest"),
    (Abort("stop", "g1"), ("refit_abort", ("stop", "g1")), None),
    (Status(), ("status", ()), STATUS),
    (Transfer(5, 9.5), ("transfer", (5, 9.5)), STATS),
    (Commit(5), ("commit", (5,)), 5),
    (CommitStaged(6), ("commit_staged", (6,)), CommitStats(6, 0.5)),
    (DropStaged(6), ("drop_staged", ()), None),
    (Staging(), ("staging", ()), None),
]


@pytest.mark.parametrize(("call", "asked", "result"), CASES, ids=lambda c: type(c).__name__)
def test_a_call_travels_as_bytes_and_runs_its_typed_method(
    call: EngineCall[Any], asked: tuple[str, tuple[Any, ...]], result: Any
) -> None:
    worker = _Worker()
    reply = _round_trip(call, worker)
    assert worker.asked == [asked]
    assert reply.unwrap("w0", call.operation) == result


def test_the_geometry_comes_back_whole() -> None:
    assert _round_trip(engine_call("refit_geometry", ()), _Worker()).unwrap("w0", "g") == SPEC


def test_every_engine_role_method_has_a_call_taking_its_arguments() -> None:
    for name in role_methods(CollectiveStagingRole):
        method = getattr(CollectiveStagingRole, name)
        params = list(inspect.signature(method).parameters)[1:]
        args = tuple(range(len(params)))
        call = engine_call(name, args)
        assert call.operation == name
        assert [f.name for f in dataclasses.fields(call)] == params
    with pytest.raises(ValueError, match="not a method of the engine role"):
        engine_call("__init__", ())


@dataclass(frozen=True)
class Foreign(WorkerCall[Any, int]):
    """A call of another backend."""

    def run(self, target: Any) -> int:
        return 1


def test_an_unknown_call_gets_the_typed_refusal() -> None:
    """Whatever is not one of refit-nccl's calls is refused by a reply, never raised."""

    worker = _Worker()
    for data in (encode(Foreign()), pickle.dumps(("refit_commit", (5,)))):
        reply = _round_trip_bytes(data, worker)
        assert reply.error_type == "ProtocolError"
        with pytest.raises(ProtocolError, match="is not one of the EngineCall calls"):
            reply.unwrap("w0", "refit_commit")
    garbage = _round_trip_bytes(b"not a pickle", worker)
    with pytest.raises(WorkerError, match="UnpicklingError"):
        garbage.unwrap("w0", "refit_commit")
    assert worker.asked == []


def test_a_worker_without_its_receiver_refuses_every_call() -> None:
    def no_receiver() -> _Worker:
        raise ProtocolError("this worker's weight transfer engine is not refit-nccl's")

    reply = answer(encode(Commit(5)), EngineCall, no_receiver, partial=lambda: True)
    assert (reply.error_type, reply.partial) == ("ProtocolError", True)


def _round_trip_bytes(data: bytes, worker: _Worker) -> WorkerReply[Any]:
    reply = answer(data, EngineCall, lambda: worker)
    return reply_from_bytes(encode(reply), "w0")


def test_how_the_controller_runs_each_call() -> None:
    assert Transfer(5, 10.0).pauses(staged=False) and not Transfer(5, 10.0).pauses(staged=True)
    assert Transfer(5, 10.0).stages(staged=True) and not Commit(5).stages(staged=True)
    assert Transfer(5, 10.0).rpc_timeout_s(120.0, 30.0) == 40.0
    assert Transfer(5, None).rpc_timeout_s(120.0, 30.0) is None
    assert Join(JOIN).rpc_timeout_s(120.0, 30.0) == 35.0
    assert Status().rpc_timeout_s(120.0, 30.0) == 120.0
    assert Commit(5).served(5) == 5 and CommitStaged(6).served(CommitStats(6, 0.1)) == 6
    assert CommitStaged(6).timed(CommitStats(6, 0.1), 2.0) == CommitStats(6, 2.0)
    assert not Status().writes and Commit(5).writes and not Abort("x").writes
