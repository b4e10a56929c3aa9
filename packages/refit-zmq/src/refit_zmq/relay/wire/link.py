"""One DEALER socket to one relay, recreated after a timeout: the lazy pirate's connection.

Sends wait for room with a deadline (``IMMEDIATE`` keeps messages from queueing for a relay
that is not connected), receives poll with a deadline, and every socket has bounded
reconnects, a connect and handshake timeout and heartbeats (a peer silent past
``heartbeat_timeout_s`` is disconnected, even without a TCP reset).

While a link is being established, a socket monitor turns a failed security handshake (plain
client against a CURVE relay, wrong server key) into an ``AuthenticationError`` and a refused
connection (nothing listens: the relay is gone) into an immediate failure, instead of silent
timeouts. The monitor lives only that long: it is stopped once the handshake succeeded or the
connection was refused, because libzmq's I/O thread blocks on a full monitor pipe, and an
unread monitor of a link to a dead address (one event per reconnect attempt) would stall
every socket of the context after about two thousand attempts. Whoever owns a link drains its
monitor whenever it waits on it (:meth:`Link.poll_events`), and closes links it no longer
uses (linger 0). Beyond that discipline, the monitor's pipe has no high-water mark (an
unread monitor costs a few bytes per event instead of stalling the context), and a relay's
own links to its children are not watched at all (``watched=False``: a child that refuses is
found by the child timeout instead): relays under chaos were found with the I/O thread of
their one context blocked in a monitor send, their listening socket no longer accepting, so
that the controller declared live relays dead, and only their child links had monitors.
"""

from __future__ import annotations

import errno
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from refit_core import AuthenticationError, ProtocolError, RefitTimeoutError
from refit_zmq.codec.format import BytesLike
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.errors import NackCode
from refit_zmq.relay.wire.frames import MAX_HEADER_BYTES, Kind, Message, parse
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["Link", "LinkSettings", "socket_options"]

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENTS = (
    _HANDSHAKE_FAILURES
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CONNECTED
)
_DROPPED_HANDSHAKES = 3
"""Connections a peer closes in a row during the handshake before the link gives up: a
CURVE relay may reset a plain client's connection before the client read the relay's
greeting, which libzmq reports without detail."""
_PEER_CLOSED = frozenset({errno.ECONNRESET, errno.EPIPE})
"""The errno of a handshake the peer cut (a handshake that timed out reports EAGAIN)."""
_NO_KEY = Signer(None)
_MONITORS = itertools.count()


def socket_options(
    socket: zmq.Socket[bytes], *, hwm: int, max_message_bytes: int, tuning: RelayTuning
) -> None:
    """Options every relay-protocol socket gets: no linger, bounded queues and frames,
    heartbeats, bounded reconnects and handshakes."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    socket.setsockopt(zmq.HEARTBEAT_IVL, _ms(tuning.heartbeat_s))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(tuning.heartbeat_timeout_s))
    socket.setsockopt(zmq.HEARTBEAT_TTL, _ms(tuning.heartbeat_timeout_s))
    socket.setsockopt(zmq.HANDSHAKE_IVL, _ms(tuning.heartbeat_timeout_s))
    socket.setsockopt(zmq.RECONNECT_IVL, _ms(tuning.reconnect_s))
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, _ms(tuning.reconnect_max_s))
    socket.setsockopt(zmq.CONNECT_TIMEOUT, _ms(tuning.heartbeat_timeout_s))


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class LinkSettings:
    """What every link one side opens shares: its signer, the relays' CURVE key, the tuning,
    and whether a socket monitor watches each link while it is being established (to raise a
    failed handshake or a refused connection at once)."""

    signer: Signer
    curve: CurveConfig | None
    tuning: RelayTuning
    watched: bool = True

    @classmethod
    def of(cls, signer: Signer, curve: CurveConfig | None, tuning: RelayTuning) -> LinkSettings:
        """Settings for links to relays: a link is a CURVE client, so it keeps only the
        relays' public key, never a secret one."""
        return cls(signer, None if curve is None else curve.public_only(), tuning)

    def open(self, context: zmq.Context[zmq.Socket[bytes]], address: str) -> Link:
        """A link to ``address`` with these settings."""
        return Link(context, address, self)


class Link:
    """A DEALER connected to ``address``, made on first use and remade by :meth:`reset`.

    Not thread-safe: one thread uses one link.
    """

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], address: str, settings: LinkSettings
    ) -> None:
        self.address = address
        self._context = context
        self._settings = settings
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._failure: AuthenticationError | None = None
        self.refused = False
        self._connected = False
        self._dropped = 0

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The connected socket (created on first use)."""
        if self._socket is None:
            settings = self._settings
            sock = self._context.socket(zmq.DEALER)
            socket_options(
                sock,
                hwm=settings.tuning.hwm_messages,
                max_message_bytes=MAX_HEADER_BYTES + 64,
                tuning=settings.tuning,
            )
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if settings.curve is not None:
                settings.curve.secure_client(sock)
            # A name of our own: pyzmq's default names the monitor after the socket's file
            # descriptor, which a later socket may reuse while the old endpoint still exists.
            if settings.watched:
                name = f"inproc://refit-link-monitor-{next(_MONITORS)}-{id(self):x}"
                sock.monitor(name, _EVENTS)
                monitor = self._context.socket(zmq.PAIR)
                monitor.setsockopt(zmq.LINGER, 0)
                monitor.setsockopt(zmq.RCVHWM, 0)  # an inproc pipe is unbounded when one end is
                monitor.connect(name)
                self._monitor = monitor
            sock.connect(self.address)
            self._socket = sock
        return self._socket

    @property
    def monitored(self) -> bool:
        """Whether the link is still being established (its monitor runs)."""
        return self._monitor is not None

    def poll_events(self) -> None:
        """Take in the socket's events while it is being established; raise on a failed
        handshake.

        ``refused`` is set when this socket's connection attempts fail before it ever
        connected (a reconnect after a dropped connection does not count: a failing
        handshake looks like that). The monitor stops once the handshake succeeded or the
        connection was refused.

        Raises:
            AuthenticationError: the relay refused the security handshake.
        """
        monitor = self._monitor
        while self._monitor is not None and monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)
            assert isinstance(event, dict)
            self._on_event(int(event["event"]), int(event["value"]))
        if self._failure is not None:
            raise self._failure

    def _on_event(self, kind: int, value: int) -> None:
        if kind & _HANDSHAKE_FAILURES:
            self._fail(f"event {kind:#x}, code {value:#x}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in _PEER_CLOSED:
            self._dropped += 1
            if self._dropped >= _DROPPED_HANDSHAKES:
                self._fail(f"{self._dropped} connections closed by the relay mid-handshake")
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._stop_monitor()
        elif kind == zmq.EVENT_CONNECTED:
            self._connected = True
        elif kind == zmq.EVENT_CONNECT_RETRIED and not self._connected:
            self.refused = True
            self._stop_monitor()

    def _fail(self, detail: str) -> None:
        self._failure = AuthenticationError(
            f"relay {self.address} refused the security handshake ({detail}): CURVE on one "
            "side only, or the wrong server key"
        )
        self._stop_monitor()

    def _stop_monitor(self) -> None:
        if self._socket is not None and self._monitor is not None:
            self._socket.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def check(self) -> None:
        """Raise if the relay refused the handshake or its connection (nothing listens).

        Raises:
            AuthenticationError: the security handshake failed.
            RefitTimeoutError: the connection was refused.
        """
        self.poll_events()
        if self.refused:
            raise RefitTimeoutError(f"relay {self.address} refused the connection (gone?)")

    def try_send(self, frames: Sequence[BytesLike], *, copy: bool = True) -> bool:
        """Send one message if there is room now; False if there is not.

        Raises:
            AuthenticationError: the security handshake failed.
            RefitTimeoutError: the connection was refused.
        """
        self.check()
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        return True

    def send(self, frames: Sequence[BytesLike], *, until: float, copy: bool = True) -> None:
        """Send one message, waiting for room until the ``time.monotonic()`` instant ``until``."""
        while not self.try_send(frames, copy=copy):
            if time.monotonic() >= until:
                raise RefitTimeoutError(f"relay {self.address}: no room to send (not connected?)")
            self.socket.poll(_wait_ms(until), zmq.POLLOUT)

    def receive(self, accept: Callable[[Message], bool], *, until: float) -> Message | None:
        """The first reply ``accept`` takes, or None at ``until``; others are dropped.

        Raises:
            AuthenticationError: the relay refused our key or the security handshake.
        """
        sock = self.socket
        while True:
            self.poll_events()
            if not sock.poll(_wait_ms(until), zmq.POLLIN):
                if time.monotonic() >= until or self.refused:
                    return None
                continue
            message = self._parse(sock.recv_multipart())
            if message is not None and accept(message):
                self.poll_events()  # a reply came: the handshake succeeded, the monitor stops
                return message
            logger.debug("relay %s: dropped an unexpected reply", self.address)

    def _parse(self, frames: list[bytes]) -> Message | None:
        """The reply, None if it is not one of ours; raise on an AUTH refusal (sent unsigned)."""
        message: Message | None
        try:
            message = parse(frames, self._settings.signer)
        except AuthenticationError:
            message = _unsigned(frames)
            if message is None:
                logger.warning("relay %s: dropped a reply with a bad MAC", self.address)
                return None
        except ProtocolError as exc:
            logger.warning("relay %s: dropped a malformed reply: %s", self.address, exc)
            return None
        if message.kind is Kind.NACK and message.text("code") == NackCode.AUTH:
            raise AuthenticationError(
                f"relay {self.address} refused the API key: {message.text('message')}"
            )
        return message

    def reset(self) -> None:
        """Close the socket (dropping anything queued); the next use connects afresh."""
        self._stop_monitor()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self._failure = None
        self.refused = False
        self._connected = False
        self._dropped = 0

    close = reset


def _unsigned(frames: list[bytes]) -> Message | None:
    """An AUTH NACK (relays cannot sign those for a peer without the key), else None."""
    try:
        message = parse(frames, _NO_KEY)
    except ProtocolError:
        return None
    if message.kind is Kind.NACK and message.text("code") == NackCode.AUTH:
        return message
    return None


def _wait_ms(until: float) -> int:
    return max(0, min(100, int((until - time.monotonic()) * 1000) + 1))
