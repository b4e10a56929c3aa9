"""refit-zmq's calls into vLLM workers: the controller's ``call_workers`` sends typed call
objects as bytes, the worker extension's one method runs each on the typed method it names
and answers with a reply that never raises.

The workers here are the real :class:`~refit_zmq.vllm.worker.ZmqWorkerExtension` mixed into a
worker that records vLLM's update-session steps, reached through a client that runs an RPC on
every worker by the method's name, as vLLM's ``collective_rpc`` does (a real engine: the
engine tier, ``tests/engine/test_ipc.py`` and ``tests/engine/test_zmq_sparse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from refit_core import ProtocolError, WorkerError
from refit_core.backend import WorkerCall, encode, reply_from_bytes
from refit_zmq.vllm.calls import (
    Address,
    FinishUpdate,
    InitReceiver,
    Partial,
    StartUpdate,
    UpdateWeights,
    Versions,
)
from refit_zmq.vllm.engines import call_workers
from refit_zmq.vllm.worker import ZmqWorkerExtension


@dataclass
class _Receiver:
    address: str
    partial: bool
    versions: tuple[int, int]


class _Worker(ZmqWorkerExtension):
    """A vLLM worker with refit-zmq's extension: its update session recorded."""

    def __init__(self, receiver: _Receiver | None) -> None:
        self.weight_transfer_engine = receiver
        self.steps: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.steps.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.steps.append(("start", None))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.steps.append(("update", update_info))

    def finish_weight_update(self) -> None:
        self.steps.append(("finish", None))


class _Engine:
    """A :class:`~refit_core.vllm.VllmClient` running each RPC on every worker by name."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers

    def collective_rpc(self, method: str, timeout_s: float | None, args: tuple[Any, ...]) -> Any:
        return [getattr(worker, method)(*args) for worker in self.workers]

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def drop_prefix_cache(self) -> None: ...

    def set_weight_version(self, version: str) -> None: ...

    def weight_version(self) -> str:
        return "0"


@dataclass(frozen=True)
class Foreign(WorkerCall[Any, int]):
    """A call of another backend."""

    def run(self, target: Any) -> int:
        return 1


def _engine() -> _Engine:
    return _Engine(
        [
            _Worker(_Receiver("tcp://10.0.0.1:5000", partial=False, versions=(3, 4))),
            _Worker(_Receiver("tcp://10.0.0.2:5000", partial=True, versions=(3, 3))),
        ]
    )


def test_each_call_runs_its_typed_method_on_every_worker() -> None:
    engine = _engine()
    assert call_workers(engine, "e0", Address(), 5.0) == [
        "tcp://10.0.0.1:5000",
        "tcp://10.0.0.2:5000",
    ]
    assert call_workers(engine, "e0", Partial(), 5.0) == [False, True]
    assert call_workers(engine, "e0", Versions(), 5.0) == [(3, 4), (3, 3)]
    for call in (InitReceiver({"staged": True}), StartUpdate(), UpdateWeights({"version": 5})):
        assert call_workers(engine, "e0", call, 5.0) == [None, None]
    call_workers(engine, "e0", FinishUpdate(), 5.0)
    steps = [
        ("init", {"staged": True}),
        ("start", None),
        ("update", {"version": 5}),
        ("finish", None),
    ]
    assert [w.steps for w in engine.workers] == [steps, steps]


def test_a_worker_without_a_receiver_answers_why() -> None:
    engine = _Engine([_Worker(_Receiver("tcp://a", partial=False, versions=(0, 0))), _Worker(None)])
    with pytest.raises(WorkerError, match=r"rank 1: RefitError: no refit-zmq receiver") as raised:
        call_workers(engine, "e0", Address(), 5.0)
    assert raised.value.operation == "Address"


def test_an_unknown_call_gets_the_typed_refusal() -> None:
    """Whatever is not one of refit-zmq's calls is refused by a reply on every worker."""
    engine = _engine()
    for data in (encode(Foreign()), b"not a pickle"):
        answers = engine.collective_rpc("refit_zmq_call", 5.0, (data,))
        replies = [reply_from_bytes(a, f"rank {r}") for r, a in enumerate(answers)]
        assert all(not r.ok for r in replies)
    with pytest.raises(ProtocolError, match="Foreign is not one of the ZmqCall calls"):
        call_workers(engine, "e0", Foreign(), 5.0)  # type: ignore[arg-type]
    assert [w.steps for w in engine.workers] == [[], []]
