"""Links to relays that die must never stall their ZeroMQ context.

libzmq's I/O thread blocks when a socket monitor's pipe is full, and a link to a dead
address reports one event per reconnect attempt: an unread monitor stalls every socket of the
context after about a thousand attempts (about 300 s at the default 100 ms interval; these
tests reconnect every millisecond to get there in seconds).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from relay_helpers import TUNING, fresh_trainer, make_state

from refit_core import AuthenticationError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_zmq.relay import RelayCoordinator, RelayStatus, TensorReceiver, ZmqSparseRefitServer
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import Kind, encode
from refit_zmq.relay.wire.link import Link, LinkSettings
from refit_zmq.relay.wire.tuning import RelayTuning

pytestmark = pytest.mark.timeout(60, method="thread")

NO_KEY = Signer(None)
FAST = RelayTuning(reconnect_s=0.001, reconnect_max_s=0.001)
"""Reconnect every millisecond: a monitor left unread fills within a few seconds."""
IDLE_S = 4.0


def _serves(context: zmq.Context[zmq.Socket[bytes]]) -> bool:
    """Whether a fresh ROUTER/DEALER pair of ``context`` still exchanges a message."""
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        for sock in (router, dealer):
            sock.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"ping")
        return bool(router.poll(2000))
    finally:
        router.close()
        dealer.close()


@contextlib.contextmanager
def _context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A context, closed afterwards unless it stalled (a stalled context cannot be closed:
    the test then fails instead of hanging in the teardown)."""
    created: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield created
    created.destroy(linger=0)


def test_an_idle_link_to_a_relay_that_died_leaves_its_context_serving() -> None:
    with _context() as context:
        _idle_after_death(context)


def _idle_after_death(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    peer: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = peer.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    link = LinkSettings(NO_KEY, None, FAST).open(context, address)
    link.send(encode(Kind.STATUS, {"request_id": "r1"}, NO_KEY), until=time.monotonic() + 5)
    assert router.poll(5000)
    identity, *_ = router.recv_multipart()
    done = {"request_id": "r1", "relay": address, "result": {}}
    router.send_multipart([identity, *encode(Kind.DONE, done, NO_KEY)])
    assert link.receive(lambda m: True, until=time.monotonic() + 5) is not None
    router.close()
    peer.term()  # the relay dies; the link reconnects to nothing, every millisecond
    time.sleep(IDLE_S)
    assert _serves(context), "the context stalled behind the idle link"
    assert not link.monitored, "an established link keeps no monitor"
    link.close()


def test_a_link_refused_once_then_left_idle_leaves_its_context_serving() -> None:
    with _context() as context:
        _idle_after_refusal(context)


def _idle_after_refusal(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with socket.socket() as probe:  # a port nothing listens on any more
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    link = Link(context, f"tcp://127.0.0.1:{port}", LinkSettings(NO_KEY, None, FAST))
    frames = encode(Kind.STATUS, {"request_id": "r1"}, NO_KEY)
    with pytest.raises(RefitTimeoutError, match="refused the connection"):
        link.send(frames, until=time.monotonic() + 5)
    time.sleep(IDLE_S)
    assert _serves(context), "the context stalled behind the idle link"
    assert not link.monitored, "a refused link stops its monitor"
    link.close()


def test_a_link_whose_monitor_is_never_read_leaves_its_context_serving() -> None:
    with _context() as context:
        with socket.socket() as probe:  # a port nothing listens on any more
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        link = Link(context, f"tcp://127.0.0.1:{port}", LinkSettings(NO_KEY, None, FAST))
        assert link.socket is not None and link.monitored, "connecting, watched, never read"
        time.sleep(IDLE_S)  # thousands of reconnect attempts, one event each
        assert _serves(context), "the context stalled behind the unread monitor"
        link.close()


def _relay(tuning: RelayTuning) -> ZmqSparseRefitServer:
    receiver = TensorReceiver(make_state(5), version=0)
    return ZmqSparseRefitServer(receiver, api_key_env_var=None, timeout_s=2.0, tuning=tuning)


def test_relays_and_the_coordinator_keep_answering_after_a_relay_died() -> None:
    tuning = RelayTuning(
        chunk_bytes=TUNING.chunk_bytes,
        max_inflight_bytes=TUNING.max_inflight_bytes,
        retries=0,
        reconnect_s=0.001,
        reconnect_max_s=0.001,
    )
    survivor, victim = _relay(tuning), _relay(tuning)
    addresses = [survivor.start(), victim.start()]
    coordinator = RelayCoordinator(api_key=None, timeout_s=2.0, tuning=tuning)
    try:
        coordinator.configure_tree(addresses, deadline=Deadline.never())
        fresh_trainer(coordinator, seed=5).close()  # the survivor forwarded to the victim
        victim.close()
        time.sleep(IDLE_S)  # the survivor's and the coordinator's links to the victim idle
        coordinator.configure_tree(addresses[:1], deadline=Deadline.never())
        time.sleep(IDLE_S)
        status = coordinator.status(deadline=Deadline.never())[addresses[0]]
        assert isinstance(status, RelayStatus), f"the survivor went deaf: {status}"
    finally:
        coordinator.close()
        survivor.close()
        victim.close()


class _TcpPeer:
    """A TCP listener that is no relay: it closes every connection at once, or holds it
    open without a word (a frozen process's kernel still accepts)."""

    def __init__(self, *, close: bool) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._server.getsockname()[1]}"
        self._close = close
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._server.accept()
                if self._close:
                    connection.close()
                else:
                    self._held.append(connection)

    def stop(self) -> None:
        self._server.close()
        for connection in self._held:
            connection.close()


@pytest.mark.parametrize("cut", [True, False])
def test_only_a_peer_that_cuts_every_handshake_is_a_refusal(cut: bool) -> None:
    """Closed mid-handshake three times in a row: refused (how a CURVE relay can end a plain
    client's attempts); held without a word: a timeout, never an authentication failure."""
    peer = _TcpPeer(close=cut)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    tuning = RelayTuning(
        reconnect_s=0.01, reconnect_max_s=0.01, heartbeat_s=0.1, heartbeat_timeout_s=0.3
    )
    link = LinkSettings(NO_KEY, None, tuning).open(context, peer.address)
    frames = encode(Kind.STATUS, {"request_id": "r1"}, NO_KEY)
    try:
        if cut:
            with pytest.raises(AuthenticationError, match="mid-handshake"):
                link.send(frames, until=time.monotonic() + 10)
        else:
            with pytest.raises(RefitTimeoutError, match="no room to send"):
                link.send(frames, until=time.monotonic() + 2)
    finally:
        link.close()
        context.destroy(linger=0)
        peer.stop()
