"""One DEALER socket to one relay, recreated after a timeout: the lazy pirate's connection.

Sends wait for room with a deadline (``IMMEDIATE`` keeps messages from queueing for a relay
that is not connected), receives poll with a deadline, and a socket monitor turns a failed
security handshake (plain client against a CURVE relay, wrong server key) into an
``AuthenticationError`` and a refused connection (nothing listens: the relay is gone) into an
immediate failure, instead of silent timeouts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from refit_core import AuthenticationError, ProtocolError, RefitTimeoutError
from refit_zmq.codec.format import BytesLike
from refit_zmq.relay.auth import Signer
from refit_zmq.relay.curve import CurveConfig
from refit_zmq.relay.errors import NackCode
from refit_zmq.relay.frames import MAX_HEADER_BYTES, Kind, Message, parse
from refit_zmq.relay.tuning import RelayTuning

__all__ = ["Link", "LinkSettings", "socket_options"]

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENTS = _HANDSHAKE_FAILURES | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED
_NO_KEY = Signer(None)


def socket_options(socket: zmq.Socket[bytes], *, hwm: int, max_message_bytes: int) -> None:
    """Options every relay-protocol socket gets: no linger, bounded queues, bounded frames."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


@dataclass(frozen=True)
class LinkSettings:
    """What every link one side opens shares: its signer, the relays' CURVE key, the HWM."""

    signer: Signer
    curve: CurveConfig | None
    hwm: int

    @classmethod
    def of(cls, signer: Signer, curve: CurveConfig | None, tuning: RelayTuning) -> LinkSettings:
        """Settings for links to relays: a link is a CURVE client, so it keeps only the
        relays' public key, never a secret one."""
        return cls(signer, None if curve is None else curve.public_only(), tuning.hwm_messages)

    def open(self, context: zmq.Context[zmq.Socket[bytes]], address: str) -> Link:
        """A link to ``address`` with these settings."""
        return Link(context, address, signer=self.signer, curve=self.curve, hwm=self.hwm)


class Link:
    """A DEALER connected to ``address``, made on first use and remade by :meth:`reset`.

    Not thread-safe: one thread uses one link.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        address: str,
        *,
        signer: Signer,
        curve: CurveConfig | None,
        hwm: int,
    ) -> None:
        self.address = address
        self._context = context
        self._signer = signer
        self._curve = curve
        self._hwm = hwm
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self.refused = False
        self._connected = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The connected socket (created on first use)."""
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            socket_options(sock, hwm=self._hwm, max_message_bytes=MAX_HEADER_BYTES + 64)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if self._curve is not None:
                self._curve.secure_client(sock)
            self._monitor = sock.get_monitor_socket(_EVENTS)
            sock.connect(self.address)
            self._socket = sock
        return self._socket

    def poll_events(self) -> None:
        """Take in the socket's events; raise on a failed handshake.

        ``refused`` is set when this socket's connection attempts fail before it ever
        connected (a reconnect after a dropped connection does not count: a failing
        handshake looks like that).

        Raises:
            AuthenticationError: the relay refused the security handshake.
        """
        monitor = self._monitor
        while monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)
            assert isinstance(event, dict)
            kind = event["event"]
            if kind & _HANDSHAKE_FAILURES:
                raise AuthenticationError(
                    f"relay {self.address} refused the security handshake (event {kind:#x}, "
                    f"code {event['value']:#x}): CURVE on one side only, or the wrong server key"
                )
            self._connected |= kind == zmq.EVENT_CONNECTED
            self.refused = kind == zmq.EVENT_CONNECT_RETRIED and not self._connected

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
                return message
            logger.debug("relay %s: dropped an unexpected reply", self.address)

    def _parse(self, frames: list[bytes]) -> Message | None:
        """The reply, None if it is not one of ours; raise on an AUTH refusal (sent unsigned)."""
        message: Message | None
        try:
            message = parse(frames, self._signer)
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
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close(linger=0)
            self._socket = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        self.refused = False
        self._connected = False

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
