"""One deadline carrier: one rule for the timeouts refit is given, one wire form."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from refit_core import InvalidTimeoutError, ProtocolError, create_weight_synchronizer
from refit_core.backend import Deadline, checked_timeout_s

BAD = [0, -1, -0.5, float("inf"), float("-inf"), float("nan"), True, "5", [5]]


def _message(value: Any, name: str = "refit_timeout_s") -> str:
    return f"{name} must be None or a positive finite number of seconds, got {value!r}"


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_the_rule_refuses_with_one_typed_error(bad: Any) -> None:
    with pytest.raises(InvalidTimeoutError) as raised:
        checked_timeout_s("refit_timeout_s", bad)
    assert str(raised.value) == _message(bad)
    assert isinstance(raised.value, ValueError)  # callers that catch the builtin keep working


def test_the_rule_takes_none_and_positive_numbers_as_floats() -> None:
    assert checked_timeout_s("t", None) is None
    assert checked_timeout_s("t", 3) == 3.0 and isinstance(checked_timeout_s("t", 3), float)
    assert checked_timeout_s("t", 1e-3) == 1e-3


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_the_factory_and_deadline_refuse_by_the_same_rule(bad: Any) -> None:
    """The factory checks the timeout before it looks up the backend, with the rule's error."""
    with pytest.raises(InvalidTimeoutError) as factory:
        create_weight_synchronizer(None, None, "no-such-backend", True, refit_timeout_s=bad)
    assert str(factory.value) == _message(bad)
    with pytest.raises(InvalidTimeoutError) as after:
        Deadline.after(bad, name="refit_timeout_s")
    assert str(after.value) == _message(bad)


@pytest.mark.parametrize("left_s", [None, 0.0, 0, 0.2, 30, 1e6])
def test_the_wire_form_round_trips(left_s: float | None) -> None:
    sent = Deadline.from_wire(left_s)
    back = Deadline.from_wire(sent.to_wire())
    assert sent.armed is back.armed is (left_s is not None)
    if left_s is None:
        assert sent.to_wire() is None and back.remaining_s() is None
        return
    wired = sent.to_wire()
    assert wired is not None and 0 <= wired <= left_s
    assert back.at is not None and sent.at is not None
    assert back.at <= sent.at + 1e-3  # a crossing never lengthens a deadline
    assert math.isclose(back.at, sent.at, abs_tol=0.05)
    assert back.expired() is (left_s == 0)


def test_a_passed_deadline_crosses_as_zero_and_arrives_passed() -> None:
    deadline = Deadline.after(0.01)
    time.sleep(0.02)
    assert deadline.to_wire() == 0.0
    assert Deadline.from_wire(deadline.to_wire()).expired()


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "1", {}], ids=repr)
def test_a_malformed_wire_deadline_is_a_protocol_error(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="deadline on the wire"):
        Deadline.from_wire(bad)
