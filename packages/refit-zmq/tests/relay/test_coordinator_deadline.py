"""The coordinator takes each call's deadline as an argument and keeps no timeout that
callers rewrite: every request ends by the deadline it was given, however long
``timeout_s`` is."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from relay_helpers import TUNING

from refit_core import RefitError
from refit_core.backend import Deadline
from refit_zmq.relay import (
    RelayCoordinator,
    ZmqSparseRefitClient,
    decide_transfer,
    deliver_payloads,
    prepare_transfer,
    run_transfer,
    stream_sparse_delta_payloads_via_zmq,
)

pytestmark = pytest.mark.timeout(60, method="thread")

DEADLINE_S = 1.0
SLACK_S = 1.0
"""Released by the deadline plus this (a decision's grace and polling), not by ``timeout_s``."""


@pytest.fixture
def silent_relay() -> Iterator[str]:
    """A ZeroMQ peer that takes every request and never answers (a frozen relay)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    router.close(linger=0)
    context.term()


def test_the_timeout_is_read_only() -> None:
    coordinator = RelayCoordinator(api_key=None, timeout_s=30.0, tuning=TUNING)
    try:
        assert coordinator.timeout_s == 30.0
        with pytest.raises(AttributeError):
            coordinator.timeout_s = 1.0  # type: ignore[misc]
    finally:
        coordinator.close()


@pytest.mark.parametrize(
    "call",
    [
        RelayCoordinator.configure_tree,
        RelayCoordinator.status,
        RelayCoordinator.close_open_transfers,
        RelayCoordinator.finish,
        RelayCoordinator.flush,
        RelayCoordinator.decide,
        ZmqSparseRefitClient.send_payload,
        run_transfer,
        prepare_transfer,
        decide_transfer,
        deliver_payloads,
        stream_sparse_delta_payloads_via_zmq,
    ],
    ids=lambda call: call.__qualname__,
)
def test_every_relay_call_requires_its_deadline(call: Callable[..., object]) -> None:
    deadline = inspect.signature(call).parameters["deadline"]
    assert deadline.kind is inspect.Parameter.KEYWORD_ONLY
    assert deadline.default is inspect.Parameter.empty


@pytest.mark.parametrize("request_kind", ["configure_tree", "status"])
def test_a_frozen_relay_releases_each_call_by_its_own_deadline(
    silent_relay: str, request_kind: str
) -> None:
    """One coordinator, ``timeout_s`` 30 s: each call still ends by the deadline it got."""
    coordinator = RelayCoordinator(api_key=None, timeout_s=30.0, tuning=TUNING)
    try:
        for _ in range(2):  # a second call with a fresh deadline is bounded alike
            started = time.monotonic()
            deadline = Deadline.after(DEADLINE_S)
            if request_kind == "configure_tree":
                with pytest.raises(RefitError, match="configuring the tree"):
                    coordinator.configure_tree([silent_relay], deadline=deadline)
            else:
                (status,) = coordinator.status(relays=[silent_relay], deadline=deadline).values()
                assert isinstance(status, RefitError)
            elapsed = time.monotonic() - started
            assert elapsed < DEADLINE_S + SLACK_S, f"{request_kind} took {elapsed:.2f} s"
    finally:
        coordinator.close()
