"""Controller-side participants and gathering their answers by a deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Protocol

import pytest

from refit_core import RefitTimeoutError
from refit_core.backend import InFlight, LocalParticipant, gather, method_name, role_methods


class Role(Protocol):
    def answer(self, value: int) -> int: ...

    def fail(self) -> None: ...

    def hang(self) -> None: ...


class Endpoint(Role):
    def __init__(self) -> None:
        self.release = threading.Event()

    def answer(self, value: int) -> int:
        return value

    def fail(self) -> None:
        raise RefitTimeoutError("peer lost")

    def hang(self) -> None:
        self.release.wait(30)


@pytest.fixture
def endpoints() -> Iterator[list[tuple[Endpoint, LocalParticipant[Role]]]]:
    created = [
        (e, LocalParticipant[Role](e, f"p{i}")) for i, e in enumerate(Endpoint() for _ in range(3))
    ]
    yield created
    for endpoint, participant in created:
        endpoint.release.set()
        participant.close()


@pytest.mark.timeout(20)
def test_results_errors_and_missing_are_sorted(
    endpoints: list[tuple[Endpoint, LocalParticipant[Role]]],
) -> None:
    (_, a), (_, b), (_, c) = endpoints
    gathered = gather(
        {a: a.call(Role.answer, 7), b: b.call(Role.fail), c: c.call(Role.hang)}, timeout_s=0.5
    )
    assert gathered.results == {a: 7}
    assert isinstance(gathered.errors[b], RefitTimeoutError)
    assert gathered.missing == [c]
    assert not gathered.ok


@pytest.mark.timeout(20)
def test_stops_waiting_at_settle_once_a_call_failed(
    endpoints: list[tuple[Endpoint, LocalParticipant[Role]]],
) -> None:
    (_, a), (_, b), _ = endpoints
    started = time.monotonic()
    gathered = gather(
        {a: a.call(Role.fail), b: b.call(Role.hang)}, timeout_s=10, settle_at=started + 0.3
    )
    assert time.monotonic() - started < 5
    assert gathered.missing == [b]


@pytest.mark.timeout(20)
def test_settle_does_not_cut_short_calls_that_all_succeed(
    endpoints: list[tuple[Endpoint, LocalParticipant[Role]]],
) -> None:
    (first, a), _, _ = endpoints
    threading.Timer(0.5, first.release.set).start()
    gathered = gather({a: a.call(Role.hang)}, timeout_s=10, settle_at=time.monotonic())
    assert gathered.ok


@pytest.mark.timeout(20)
def test_a_blocked_call_does_not_hold_back_the_next(
    endpoints: list[tuple[Endpoint, LocalParticipant[Role]]],
) -> None:
    (_, a), _, _ = endpoints
    hanging = [a.call(Role.hang) for _ in range(3)]
    assert a.call(Role.answer, 3).result(timeout=5) == 3
    assert not any(f.done() for f in hanging)


def test_calls_name_a_role_method() -> None:
    assert method_name(Role.answer) == "answer"
    assert role_methods(Role) == {"answer", "fail", "hang"}
    participant = LocalParticipant[Role](Endpoint(), "p")
    with pytest.raises(ValueError, match="not a public method of a participant role"):
        participant.call(lambda endpoint: endpoint.answer(1))
    participant.close()
    with pytest.raises(RuntimeError, match="closed"):
        participant.call(Role.answer, 1)


def test_in_flight_counts_overlapping_calls() -> None:
    in_flight = InFlight()
    entered, release = threading.Event(), threading.Event()

    def call() -> None:
        with in_flight:
            entered.set()
            release.wait(10)

    worker = threading.Thread(target=call)
    worker.start()
    assert entered.wait(10)
    with in_flight:
        assert in_flight
    assert in_flight, "the other call is still running"
    release.set()
    worker.join(10)
    assert not in_flight
