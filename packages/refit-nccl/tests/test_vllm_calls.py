"""The bytes refit-nccl's endpoint calls and replies cross vLLM's ``collective_rpc`` as."""

from __future__ import annotations

import pickle

import pytest

from refit_core import (
    GeometryMismatchError,
    ProtocolError,
    Recovery,
    RefitTimeoutError,
    WorkerError,
)
from refit_core.backend import CollectiveSenderSpec
from refit_nccl.vllm.calls import (
    decode_call,
    decode_reply,
    encode_call,
    encode_reply,
    reply_pending,
)


def test_a_call_and_its_result_round_trip() -> None:
    spec = CollectiveSenderSpec("refit", 1 << 20, 2)
    method, args = decode_call(encode_call("refit_plan", ((("w", None),), spec)))
    assert (method, args) == ("refit_plan", ((("w", None),), spec))
    assert decode_reply(encode_reply(spec), "w0", method) == spec


def test_only_endpoint_methods_travel() -> None:
    with pytest.raises(ValueError, match="not an endpoint method"):
        encode_call("__init__", ())
    with pytest.raises(ProtocolError):
        decode_call(pickle.dumps(("refit_plan", ())))
    with pytest.raises(ProtocolError):
        decode_reply(pickle.dumps("ok"), "w0", "refit_plan")


def test_errors_come_back_typed_and_named() -> None:
    refused = encode_reply(error=GeometryMismatchError("lm_head.weight: other shape"))
    with pytest.raises(GeometryMismatchError, match=r"w0: refit_plan: lm_head\.weight"):
        decode_reply(refused, "w0", "refit_plan")
    with pytest.raises(RefitTimeoutError, match="late") as timed_out:
        decode_reply(encode_reply(error=TimeoutError("late")), "w0", "refit_transfer")
    assert timed_out.value.recovery is Recovery.RECOVER
    with pytest.raises(WorkerError, match="KeyError") as other:
        decode_reply(encode_reply(error=KeyError("x")), "w0", "refit_transfer")
    assert (other.value.worker, other.value.operation) == ("w0", "refit_transfer")


def test_staging_calls_travel_and_a_running_one_says_pending() -> None:
    assert decode_call(encode_call("refit_stage", (3, 9.5))) == ("refit_stage", (3, 9.5))
    assert decode_call(encode_call("refit_drop_staged", (3,))) == ("refit_drop_staged", (3,))
    assert reply_pending(encode_reply(pending=True), "w0")
    assert not reply_pending(encode_reply(None), "w0")
    assert not reply_pending(encode_reply(error=TimeoutError("late")), "w0")
