"""A live relay (no API key, so garbage reaches the parser) answers every malformed message
with a NACK, keeps serving, and still commits a transfer afterwards.

``REFIT_HYPOTHESIS_PROFILE=full`` sends 2,000 frame lists (150 by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import zmq
from frame_strategies import frame_lists
from hypothesis import HealthCheck, assume, given, settings
from relay_helpers import TUNING, RelayFleet, RelaySpec, digests, fresh_trainer, held_digests

from refit_core import AuthenticationError, ProtocolError
from refit_core.backend import Deadline
from refit_zmq.relay import RelayCoordinator
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import Kind, parse

LIVE_EXAMPLES = 2_000 if os.environ.get("REFIT_HYPOTHESIS_PROFILE") == "full" else 150
REQUESTS = {
    Kind.BEGIN,
    Kind.DATA,
    Kind.FLUSH,
    Kind.COMMIT,
    Kind.ABORT,
    Kind.STATUS,
    Kind.OUTCOME,
    Kind.CONFIGURE,
}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def relay() -> Iterator[RelayFleet]:
    with RelayFleet([RelaySpec()]) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def dealer(relay: RelayFleet) -> Iterator[zmq.Socket[bytes]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(relay.addresses[0])
    try:
        yield socket
    finally:
        socket.close()
        context.term()


def _is_valid_request(frames: list[bytes]) -> bool:
    try:
        return parse(frames, Signer(None)).kind in REQUESTS
    except (ProtocolError, AuthenticationError):
        return False


@settings(max_examples=LIVE_EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(frames=frame_lists)
def test_relay_nacks_every_malformed_message(
    dealer: zmq.Socket[bytes], frames: list[bytes]
) -> None:
    assume(frames and not _is_valid_request(frames))
    dealer.send_multipart(frames)
    assert dealer.poll(5000), "the relay did not answer"
    reply = parse(dealer.recv_multipart(), Signer(None))
    assert reply.kind is Kind.NACK
    assert not dealer.poll(0), "one message, one answer"


def test_relay_still_commits_after_the_fuzz(relay: RelayFleet) -> None:
    coordinator = RelayCoordinator(api_key=None, timeout_s=4.0, tuning=TUNING)
    try:
        coordinator.configure_tree(relay.addresses, deadline=Deadline.never())
        trainer = fresh_trainer(coordinator, seed=41)
        trainer.step(seed=42)
        trainer.transfer(coordinator)
        assert held_digests(coordinator) == {relay.addresses[0]: digests(trainer.state)}
        trainer.close()
    finally:
        coordinator.close()
