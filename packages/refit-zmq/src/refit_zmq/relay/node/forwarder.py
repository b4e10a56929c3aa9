"""Cut-through forwarding from a relay to one child relay, driven by the relay's event loop.

Each payload is offered with BEGIN; once the child answers READY, every chunk that has
arrived so far is streamed and every later one as soon as it arrives. Payloads stream one at
a time, but the BEGINs of the next ``window_payloads - 1`` queued ones go out ahead, so their
READY round trip (which may wait behind the child's own queued traffic on a shaped link)
overlaps the current payload's stream instead of idling the link between payloads. Sends
never block: when the child's high-water mark is reached the rest waits for POLLOUT, and the
payload's bytes stay in the parent's staging (counted in its budget) until streamed. A child
that stops answering for ``timeout_s`` (or fails the security handshake) fails every payload
queued for it, and its socket is made anew, and it is given up for the rest of the transfers
it failed (they are lost there anyway): their later payloads are released at once instead of
each waiting out the child's timeout again. A child that refuses a payload (a NACK) still
gets the later ones: it forwards them to its own subtree.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from refit_core import AuthenticationError, ProtocolError, RefitTimeoutError
from refit_zmq.relay.node.staging import PayloadKey, StagedPayload
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.errors import RETRYABLE, NackCode
from refit_zmq.relay.wire.frames import Kind, Message, encode, parse
from refit_zmq.relay.wire.link import Link
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["ChildLink", "Forward", "ForwardEvents"]

logger = logging.getLogger(__name__)

_GIVEN_UP_REMEMBERED = 16
"""Transfers a child link remembers having given up (transfers run one after the other)."""


class _ChunkTooLargeError(Exception):
    """A staged chunk is larger than the child accepts."""


@dataclass(eq=False)
class Forward:
    """One payload on its way to one child."""

    staged: StagedPayload
    deadline: float
    sent: int = 0
    begun: bool = False
    ready: bool = False
    retry_at: float = 0.0
    attempts: int = 0
    accepted: int = 0
    released: bool = False

    @property
    def key(self) -> PayloadKey:
        """The payload's key."""
        return self.staged.key

    @property
    def streamed(self) -> bool:
        """Every chunk of the (complete) payload handed to the socket."""
        return self.staged.complete and self.sent == len(self.staged.chunks)


class ForwardEvents(Protocol):
    """What the relay hears from a child link."""

    def forwarded(self, child: str, forward: Forward, nbytes: int) -> None:
        """``nbytes`` of the payload went to the child's socket."""

    def released(self, forward: Forward) -> None:
        """The child link no longer needs the payload's staged bytes."""

    def acked(self, child: str, forward: Forward) -> None:
        """The child applied the payload."""

    def failed(self, child: str, forward: Forward, code: str, message: str) -> None:
        """The child refused the payload, or stopped answering."""

    def deadline_s(self, transfer_id: str) -> float | None:
        """Seconds left of the transfer's deadline (None: it has none)."""


class ChildLink:
    """Forwards payloads to one child relay without ever blocking the caller."""

    def __init__(
        self,
        link: Link,
        *,
        signer: Signer,
        events: ForwardEvents,
        timeout_s: float,
        tuning: RelayTuning,
    ) -> None:
        self.address = link.address
        self._link = link
        self._signer = signer
        self._events = events
        self._timeout_s = timeout_s
        self._tuning = tuning
        self._queue: deque[Forward] = deque()
        self._current: Forward | None = None
        self._unacked: dict[PayloadKey, Forward] = {}
        self._given_up: deque[str] = deque(maxlen=_GIVEN_UP_REMEMBERED)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The DEALER to poll."""
        return self._link.socket

    def _all(self) -> Iterator[Forward]:
        if self._current is not None:
            yield self._current
        yield from self._queue
        yield from self._unacked.values()

    def busy(self, transfer_id: str) -> bool:
        """Whether a payload of ``transfer_id`` is queued, streaming or awaiting its ACK."""
        return any(f.key[0] == transfer_id for f in self._all())

    def wants_to_send(self) -> bool:
        """Whether the link is waiting for room on its socket."""
        current = self._current
        if current is None:
            return bool(self._queue)
        if not current.begun:
            return time.monotonic() >= current.retry_at
        return current.ready and current.sent < len(current.staged.chunks)

    def gave_up(self, transfer_id: str) -> bool:
        """Whether the child went silent during ``transfer_id`` (it gets no more of it)."""
        return transfer_id in self._given_up

    def add(self, staged: StagedPayload) -> bool:
        """Queue ``staged`` for this child (its ``forwards`` count goes up); False, and
        nothing queued, when the child was given up for the payload's transfer."""
        if self.gave_up(staged.key[0]):
            return False
        staged.forwards += 1
        self._queue.append(Forward(staged, time.monotonic() + self._timeout_s))
        self.pump()
        return True

    def _give_up(self, transfer_id: str) -> None:
        if transfer_id not in self._given_up:
            self._given_up.append(transfer_id)

    def pump(self) -> None:
        """Send whatever can be sent now (called on every turn of the relay's loop, which
        also drains the link's monitor while the link is being established)."""
        try:
            self._link.poll_events()
            self._pump()
        except (AuthenticationError, RefitTimeoutError) as exc:
            self._fail_all(str(exc))

    def _pump(self) -> None:
        self._begin_ahead()
        while True:
            if self._current is None:
                if not self._queue:
                    return
                self._current = self._queue.popleft()
                self._current.deadline = time.monotonic() + self._timeout_s
            current = self._current
            if not current.begun and (
                time.monotonic() < current.retry_at or not self._send_begin(current)
            ):
                return
            try:
                streaming = current.ready and self._send_chunks(current)
            except _ChunkTooLargeError as exc:
                self._current = None
                self._release(current)
                self._events.failed(self.address, current, NackCode.TOO_LARGE, str(exc))
                continue
            if not streaming:
                return
            if not current.streamed:
                return
            self._current = None
            current.deadline = time.monotonic() + self._timeout_s
            self._unacked[current.key] = current
            self._release(current)

    def _begin_ahead(self) -> None:
        """Send BEGIN for the queued payloads next in line (within the child's window)."""
        now = time.monotonic()
        for forward in list(self._queue)[: max(0, self._tuning.window_payloads - 1)]:
            if forward.begun or now < forward.retry_at:
                continue
            if not self._send_begin(forward):
                return
            forward.deadline = now + self._timeout_s

    def _send(self, frames: list[Any]) -> bool:
        return self._link.try_send(frames, copy=False)

    def _send_begin(self, forward: Forward) -> bool:
        staged = forward.staged
        transfer_id, producer_id, payload_id = staged.key
        fields = {
            **staged.begin,
            "transfer_id": transfer_id,
            "producer_id": producer_id,
            "payload_id": payload_id,
            "total_bytes": staged.total_bytes,
            "deadline_s": self._events.deadline_s(transfer_id),
        }
        if not self._send(encode(Kind.BEGIN, fields, self._signer)):
            return False
        forward.begun = True
        forward.attempts += 1
        return True

    def _send_chunks(self, forward: Forward) -> bool:
        """Stream the chunks that have arrived; False when the socket is full."""
        staged = forward.staged
        transfer_id, producer_id, payload_id = staged.key
        while forward.sent < len(staged.chunks):
            offset, length = staged.chunks[forward.sent]
            if length > forward.accepted:
                raise _ChunkTooLargeError(
                    f"child accepts chunks of at most {forward.accepted} bytes, "
                    f"got one of {length} (relay tunings differ)"
                )
            fields = {
                "transfer_id": transfer_id,
                "producer_id": producer_id,
                "payload_id": payload_id,
                "checksum": staged.checksum,
                "total_bytes": staged.total_bytes,
                "offset": offset,
                "relay_root": staged.begin.get("relay_root"),
                "tree": staged.begin.get("tree"),
                "hops": staged.begin.get("hops"),
            }
            if not self._send(encode(Kind.DATA, fields, self._signer, staged.chunk(forward.sent))):
                return False
            forward.sent += 1
            forward.deadline = time.monotonic() + self._timeout_s
            self._events.forwarded(self.address, forward, length)
        return True

    def _release(self, forward: Forward) -> None:
        if not forward.released:
            forward.released = True
            self._events.released(forward)

    def receive(self) -> None:
        """Handle every reply waiting on the socket."""
        socket = self._link.socket
        while socket.poll(0, zmq.POLLIN):
            frames = socket.recv_multipart()
            try:
                message = parse(frames, self._signer)
            except (ProtocolError, AuthenticationError) as exc:
                logger.warning("child %s: dropped a reply: %s", self.address, exc)
                continue
            self._on_reply(message)
        self.pump()

    def _on_reply(self, message: Message) -> None:
        fields = message.fields
        key = (
            str(fields.get("transfer_id")),
            str(fields.get("producer_id")),
            str(fields.get("payload_id")),
        )
        if message.kind is Kind.QUEUED:
            self._queued(key)
            return
        current = self._current
        if current is not None and key == current.key:
            if message.kind is Kind.READY:
                self._ready(current, message)
                return
            if not self._finish(current, message):
                self._current = None
            return
        ahead = next((f for f in self._queue if f.begun and f.key == key), None)
        if ahead is not None:
            if message.kind is Kind.READY:
                self._ready(ahead, message)
            elif not self._finish(ahead, message):
                self._queue.remove(ahead)
            return
        if message.kind in (Kind.ACK, Kind.NACK):
            forward = self._unacked.pop(key, None)
            if forward is not None:
                self._finish(forward, message)

    def _queued(self, key: PayloadKey) -> None:
        """The child is alive and holds the BEGIN of ``key`` until it has room: the wait
        for its READY starts again."""
        current = self._current
        if current is not None and current.key == key and current.begun and not current.ready:
            current.deadline = time.monotonic() + self._timeout_s

    def _ready(self, forward: Forward, message: Message) -> None:
        forward.accepted = message.number("chunk_bytes", forward.staged.total_bytes)
        forward.ready = True
        forward.deadline = time.monotonic() + self._timeout_s

    def _finish(self, forward: Forward, message: Message) -> bool:
        """An ACK or NACK for ``forward``; True when it is to be offered again (a retryable
        NACK before READY: BEGIN again after a backoff), so the caller keeps it in place."""
        if message.kind is Kind.ACK:
            self._release(forward)
            self._events.acked(self.address, forward)
            return False
        if message.kind is not Kind.NACK:
            return False
        code = NackCode(message.text("code"))
        if code in RETRYABLE and not forward.ready:
            forward.begun = False
            forward.retry_at = time.monotonic() + self._tuning.backoff(forward.attempts - 1)
            forward.deadline = forward.retry_at + self._timeout_s
            return True
        self._release(forward)
        self._events.failed(self.address, forward, code, message.text("message"))
        return False

    def expire(self, now: float) -> None:
        """Fail everything if the child has made no progress within the timeout.

        Progress is a READY, a QUEUED for the current payload (the child is alive but has no
        room yet), a chunk taken by the socket or an ACK; payloads queued behind
        the current one have no deadline of their own.
        """
        current = self._current
        if current is not None and current.ready and current.sent == len(current.staged.chunks):
            current.deadline = (
                now + self._timeout_s
            )  # waiting for the parent's chunks, not the child
        watched = [*self._unacked.values(), *([current] if current else [])]
        if any(forward.deadline < now for forward in watched):
            self._fail_all(f"no answer within {self._timeout_s:.1f} s (dead or frozen)")

    def _fail_all(self, reason: str) -> None:
        forwards = list(self._all())
        self._current = None
        self._queue.clear()
        self._unacked.clear()
        self._link.reset()
        logger.warning(
            "child %s failed (%s); %d payloads dropped", self.address, reason, len(forwards)
        )
        for forward in forwards:
            self._give_up(forward.key[0])
        for forward in forwards:
            self._release(forward)
            self._events.failed(self.address, forward, "UNREACHABLE", reason)

    def drop(self, match: Callable[[PayloadKey], bool]) -> None:
        """Forget the payloads whose key ``match`` accepts (aborted, or stalled upstream).

        They are taken off first and released after: a release may admit another payload,
        which comes back here through :meth:`add`."""
        dropped = [f for f in self._queue if match(f.key)]
        self._queue = deque(f for f in self._queue if not match(f.key))
        for key in [k for k in self._unacked if match(k)]:
            del self._unacked[key]
        current = self._current
        if current is not None and match(current.key):
            self._current = None
            self._link.reset()
            dropped.insert(0, current)
        for forward in dropped:
            self._release(forward)

    def close(self) -> None:
        """Drop everything and close the socket."""
        forwards = list(self._all())
        self._current = None
        self._queue.clear()
        self._unacked.clear()
        self._link.close()
        for forward in forwards:
            self._release(forward)
