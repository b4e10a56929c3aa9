"""refit-core's typed worker calls: the dispatcher that never raises, and replies that come back
as the refit error of the same name."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from refit_core import (
    GeometryMismatchError,
    ProtocolError,
    Recovery,
    RefitTimeoutError,
    WorkerError,
)
from refit_core.backend import WorkerCall, WorkerReply, answer, encode, reply_from_bytes


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def add(self, amount: int) -> int:
        self.value += amount
        return self.value


@dataclass(frozen=True)
class Add(WorkerCall[_Counter, int]):
    amount: int

    def run(self, target: _Counter) -> int:
        return target.add(self.amount)


@dataclass(frozen=True)
class Refuse(WorkerCall[_Counter, int]):
    def run(self, target: _Counter) -> int:
        raise GeometryMismatchError("lm_head.weight: other shape")


class _OtherCall(WorkerCall[object, None]):
    def run(self, target: object) -> None:
        return None


def _answered(data: bytes, counter: _Counter, partial: bool = False) -> WorkerReply[object]:
    reply = answer(data, Add, lambda: counter, partial=lambda: partial)
    return reply_from_bytes(encode(reply), "w0")


def test_a_call_runs_on_its_target_and_its_result_comes_back() -> None:
    counter = _Counter()
    assert _answered(encode(Add(3)), counter).unwrap("w0", "add") == 3
    assert _answered(encode(Add(4)), counter, partial=True).partial
    assert counter.value == 7


def test_what_is_not_a_call_of_the_kind_is_refused_by_a_reply() -> None:
    counter = _Counter()
    for data in (encode(_OtherCall()), encode(WorkerReply(1)), b"\x80\x05garbage"):
        reply = _answered(data, counter)
        assert not reply.ok
    with pytest.raises(ProtocolError, match="_OtherCall is not one of the Add calls"):
        _answered(encode(_OtherCall()), counter).unwrap("w0", "add")
    assert counter.value == 0


def test_errors_come_back_typed_and_named() -> None:
    refused = answer(encode(Refuse()), Refuse, lambda: _Counter())
    with pytest.raises(GeometryMismatchError, match=r"w0: refuse: lm_head\.weight"):
        refused.unwrap("w0", "refuse")
    with pytest.raises(RefitTimeoutError, match="late") as timed_out:
        WorkerReply.failed(TimeoutError("late")).unwrap("w0", "transfer")
    assert timed_out.value.recovery is Recovery.RECOVER
    with pytest.raises(WorkerError, match="KeyError") as other:
        WorkerReply.failed(KeyError("x")).unwrap("w0", "transfer")
    assert (other.value.worker, other.value.operation) == ("w0", "transfer")


def test_only_replies_decode_as_replies() -> None:
    with pytest.raises(ProtocolError, match="not a refit reply"):
        reply_from_bytes(encode(Add(1)), "w0")
    with pytest.raises(ProtocolError, match="not a refit reply"):
        reply_from_bytes(b"garbage", "w0")
