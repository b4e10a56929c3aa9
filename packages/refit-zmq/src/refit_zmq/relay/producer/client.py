"""The producer's side of a relay link: send one payload, reliably, with a deadline.

Lazy pirate (zguide chapter 4): every wait polls with a deadline; on a timeout the socket is
closed and made anew, and the payload is offered again after a backoff, a bounded number of
times. Replies are matched by (transfer_id, producer_id, payload_id); any other reply (a late
one from an earlier attempt, a foreign one) is dropped. Retries are safe because relays apply a
payload id once per transfer and refuse the same id with another checksum.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from refit_core import AuthenticationError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_zmq.codec.format import BytesLike, DeltaPayload
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.errors import RETRYABLE, NackCode, error_for_nack
from refit_zmq.relay.wire.frames import QUEUE_TIMEOUTS, Kind, Message, encode, transfer_target
from refit_zmq.relay.wire.link import Link, LinkSettings
from refit_zmq.relay.wire.reports import ApplyResult
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["Acknowledged", "ZmqSparseRefitClient"]

logger = logging.getLogger(__name__)


def _frames(body: DeltaPayload | BytesLike | Sequence[BytesLike]) -> Sequence[BytesLike]:
    if isinstance(body, DeltaPayload):
        return body.frames
    if isinstance(body, bytes | bytearray | memoryview):
        return [body]
    return body


def _chunks(frames: Sequence[BytesLike], chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, chunk) covering the frames back to back, no chunk crossing a frame."""
    offset = 0
    for frame in frames:
        view = memoryview(frame).cast("B")
        for start in range(0, len(view), chunk_bytes):
            chunk = view[start : start + chunk_bytes]
            yield offset, chunk
            offset += len(chunk)


class _NoReplyError(Exception):
    """One attempt got no reply in time."""


@dataclass(frozen=True)
class Acknowledged:
    """A relay's ACK of one payload: who answered, whether it had the payload already
    (``duplicate``: not applied again), the attempts it took, and the receiver's result."""

    relay: str
    duplicate: bool
    attempts: int
    result: ApplyResult


class ZmqSparseRefitClient:
    """Sends payloads to one relay; thread-safe, one DEALER per calling thread.

    Args:
        address: the relay's address (``tcp://host:port``).
        timeout_s: longest wait for any one reply (admission, then the relay's apply).
        producer_id: who sends; with ``payload_id`` it names a payload within a transfer.
        retries: further attempts after a timeout or a BUSY refusal.
        api_key: the shared API key (None: the relay runs without one).
        curve: the relays' CURVE public key, when they encrypt.
        tuning: chunk size, high-water mark and backoff.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float,
        producer_id: str,
        retries: int,
        api_key: str | None = None,
        curve: CurveConfig | None = None,
        tuning: RelayTuning | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"need timeout_s > 0 and retries >= 0, got {timeout_s}, {retries}")
        self.address = address
        self.timeout_s = timeout_s
        self.producer_id = producer_id
        self.retries = retries
        self._tuning = tuning or RelayTuning()
        self._signer = Signer(api_key)
        self._settings = LinkSettings.of(self._signer, curve, self._tuning)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._local = threading.local()
        self._links: list[Link] = []
        self._lock = threading.Lock()
        self._closed = False

    def _link(self) -> Link:
        link: Link | None = getattr(self._local, "link", None)
        if link is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("client is closed")
                link = self._settings.open(self._context, self.address)
                self._links.append(link)
            self._local.link = link
        return link

    def send_payload(
        self,
        *,
        transfer_id: str,
        payload_id: str,
        checksum: str,
        verification_candidates: int,
        body: DeltaPayload | BytesLike | Sequence[BytesLike],
        relay_root: str | None = None,
        producer_id: str | None = None,
        base_version: int | None = None,
        target_version: int | None = None,
        deadline: Deadline,
    ) -> Acknowledged:
        """Deliver one payload; return the relay's ACK once it has applied it.

        Args:
            transfer_id: the transfer the payload belongs to (``v<target>-<16 hex>``).
            payload_id: unique within (transfer, producer); a retry reuses it.
            checksum: the payload's xxh3-128 (``DeltaPayload.checksum``), 32 hex digits.
            verification_candidates: changed entries every receiver re-reads after applying
                and compares with the values sent (0 disables).
            body: the payload (its frames are sent back to back, in chunks).
            relay_root: the relay whose tree carries the payload (None: the addressed one).
            producer_id: overrides the client's producer id for this payload.
            base_version: the version the payload is a delta against (None: a resync); every
                item of the payload must name it.
            target_version: the version it brings receivers to (default: the one the
                transfer id names; another is refused).
            deadline: the transfer's deadline: the BEGIN carries it (``Deadline.to_wire``),
                and no wait or retry runs past it (``Deadline.never()``: each wait takes
                ``timeout_s``).

        Raises:
            RefitTimeoutError: no answer after every attempt, or the deadline passed.
            RefitError: the relay refused the payload (a typed error per NACK code).
        """
        target = transfer_target(transfer_id)
        if target_version is not None and target_version != target:
            raise ValueError(f"transfer {transfer_id} targets {target}, not {target_version}")
        producer = producer_id or self.producer_id
        frames = _frames(body)
        total = sum(memoryview(frame).nbytes for frame in frames)
        key = (transfer_id, producer, payload_id)
        common = {
            "transfer_id": transfer_id,
            "producer_id": producer,
            "payload_id": payload_id,
            "checksum": checksum,
            "total_bytes": total,
            "relay_root": relay_root,
            "hops": 0,
        }
        begin = {
            **common,
            "verification_candidates": verification_candidates,
            "base": base_version,
            "target": target,
        }
        link = self._link()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self._tuning.backoff(attempt - 1), deadline.remaining_s() or 0.0))
            deadline.check(f"payload {payload_id} of transfer {transfer_id} reached {self.address}")
            try:
                reply = self._attempt(link, key, begin, common, frames, deadline)
            except AuthenticationError:
                link.reset()
                raise
            except _NoReplyError as exc:
                logger.warning(
                    "relay %s: payload %s attempt %d timed out (%s); reconnecting",
                    self.address,
                    payload_id,
                    attempt + 1,
                    exc,
                )
                link.reset()
                continue
            if reply.kind is Kind.ACK:
                return Acknowledged(
                    reply.text("relay"),
                    reply.flag("duplicate"),
                    attempt + 1,
                    ApplyResult.from_json(reply.mapping("result")),
                )
            code = NackCode(reply.text("code"))
            if code not in RETRYABLE:
                raise error_for_nack(
                    code, reply.text("message"), relay=reply.text("relay"), what=f"payload {key}"
                )
            logger.info("relay %s is busy; payload %s backs off", self.address, payload_id)
        raise RefitTimeoutError(
            f"relay {self.address}: payload {key} not acknowledged after "
            f"{self.retries + 1} attempts of {self.timeout_s:.1f} s "
            "(relay dead, frozen, unreachable, or its staging stayed full)"
        )

    def _attempt(
        self,
        link: Link,
        key: tuple[str, str, str],
        begin: dict[str, Any],
        common: dict[str, Any],
        frames: Sequence[BytesLike],
        deadline: Deadline,
    ) -> Message:
        """BEGIN, wait for READY (each QUEUED starts the wait again, up to the relay's own
        limit on queueing), stream the chunks, wait for ACK; the final reply."""
        begin = {**begin, "deadline_s": deadline.to_wire()}
        self._send(link, encode(Kind.BEGIN, begin, self._signer), deadline)
        queued_s = (QUEUE_TIMEOUTS + 1) * self.timeout_s
        queued_until = time.monotonic() + queued_s
        answers = (Kind.READY, Kind.QUEUED, Kind.ACK, Kind.NACK)
        reply = self._wait(link, key, answers, deadline)
        while reply.kind is Kind.QUEUED and time.monotonic() < queued_until:
            reply = self._wait(link, key, answers, deadline)
        if reply.kind is Kind.QUEUED:
            raise _NoReplyError(f"still queued after {queued_s:.1f} s")
        if reply.kind is not Kind.READY:
            return reply
        chunk_bytes = min(
            self._tuning.chunk_bytes, reply.number("chunk_bytes", self._tuning.chunk_bytes)
        )
        for offset, chunk in _chunks(frames, max(1, chunk_bytes)):
            data = encode(Kind.DATA, {**common, "offset": offset}, self._signer, chunk)
            self._send(link, data, deadline)
        return self._wait(link, key, (Kind.ACK, Kind.NACK), deadline)

    def _until(self, deadline: Deadline) -> float:
        until = time.monotonic() + self.timeout_s
        return until if deadline.at is None else min(until, deadline.at)

    def _send(self, link: Link, frames: list[BytesLike], deadline: Deadline) -> None:
        try:
            link.send(frames, until=self._until(deadline), copy=False)
        except RefitTimeoutError as exc:
            raise _NoReplyError(str(exc)) from None

    def _wait(
        self, link: Link, key: tuple[str, str, str], kinds: tuple[Kind, ...], deadline: Deadline
    ) -> Message:
        def ours(message: Message) -> bool:
            return message.kind in kinds and _key_of(message) == key

        reply = link.receive(ours, until=self._until(deadline))
        if reply is None:
            raise _NoReplyError(f"no {'/'.join(kinds)} within {self.timeout_s:.1f} s")
        return reply

    def close(self) -> None:
        """Close every thread's socket; call once no thread is sending any more."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for link in self._links:
                link.close()
        self._context.term()

    def __enter__(self) -> ZmqSparseRefitClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _key_of(message: Message) -> tuple[object, object, object]:
    fields = message.fields
    return fields.get("transfer_id"), fields.get("producer_id"), fields.get("payload_id")
