"""Control requests (FLUSH, COMMIT, ABORT, STATUS, CONFIGURE) to many relays at once.

One thread, one DEALER per relay, every request in flight together. Each relay's request is
retried on its own (lazy pirate: new socket, backoff, same request id, bounded attempts);
control requests are idempotent, so a retry after a lost reply is harmless. A relay that
never answers yields a ``RefitTimeoutError`` naming it; a NACK yields its typed error.

A relay that stopped answering is remembered: the next request to it starts on a fresh
socket (one that lost a frozen relay may be waiting out its reconnect backoff when the relay
runs again). While a request waits, a relay whose port refuses connections (its process is
dead, or it was closed) fails at once instead of at its timeout.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from refit_core import AuthenticationError, RefitError, RefitTimeoutError
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.errors import NackCode, error_for_nack
from refit_zmq.relay.wire.frames import Kind, Message, encode
from refit_zmq.relay.wire.link import Link, LinkSettings
from refit_zmq.relay.wire.liveness import refuses_connections
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["ControlChannel", "Reply"]

logger = logging.getLogger(__name__)

Reply = dict[str, Any] | RefitError
"""A relay's ``result`` (from DONE), or the error its request ended in."""

_LIVENESS_S = 0.25
"""How often a request waiting for a relay checks that its port still accepts connections."""


@dataclass
class _Call:
    kind: Kind
    fields: dict[str, Any]
    request_id: str
    reply_within_s: float
    end: float
    retries: int
    attempt: int = 0
    until: float = 0.0
    send_at: float = 0.0


class ControlChannel:
    """Sends control requests to relays in parallel and gathers their replies.

    Args:
        signer: signs requests with the shared API key (or with none).
        curve: the relays' CURVE public key, when they encrypt.
        tuning: retries, backoff, high-water mark.
    """

    def __init__(
        self,
        *,
        signer: Signer,
        curve: CurveConfig | None = None,
        tuning: RelayTuning | None = None,
    ) -> None:
        self._signer = signer
        self._tuning = tuning or RelayTuning()
        self._settings = LinkSettings.of(signer, curve, self._tuning)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._links: dict[str, Link] = {}
        self._silent: set[str] = set()

    def _link(self, address: str) -> Link:
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = self._settings.open(self._context, address)
        return link

    def call(
        self,
        requests: Mapping[str, tuple[Kind, dict[str, Any]]],
        *,
        reply_within_s: float,
        until: float | None = None,
        retries: int | None = None,
        stop_when_gone: bool = False,
    ) -> dict[str, Reply]:
        """Send ``requests`` (relay -> (kind, fields)) and wait for every answer.

        Args:
            requests: one request per relay address.
            reply_within_s: how long one attempt waits for its reply.
            until: the ``time.monotonic()`` instant by which every attempt ends, retries
                included (None: no bound besides the attempts).
            retries: further attempts after a timeout (default: the tuning's).
            stop_when_gone: once a relay is found gone, stop waiting for the others (their
                answers no longer matter: a FLUSH that cannot commit); they are left out of
                the result.

        Returns:
            Relay -> its DONE result or the error its request ended in, after at most
            ``(retries + 1) * reply_within_s`` plus backoff, and never after ``until``.
        """
        now = time.monotonic()
        end = math.inf if until is None else until
        attempts_left = self._tuning.retries if retries is None else retries
        for address in self._silent & set(requests):
            self._link(address).reset()
        calls = {
            address: _Call(
                kind, fields, uuid.uuid4().hex, reply_within_s, end, attempts_left, send_at=now
            )
            for address, (kind, fields) in requests.items()
        }
        replies: dict[str, Reply] = {}
        checked = now
        while len(replies) < len(calls):
            now = time.monotonic()
            for address, call in calls.items():
                if address not in replies:
                    self._advance(address, call, now, replies)
            waiting = [a for a in calls if a not in replies]
            if not waiting:
                break
            if now - checked >= _LIVENESS_S:
                checked = now
                if self._fail_gone(waiting, calls, replies) and stop_when_gone:
                    break
                waiting = [a for a in waiting if a not in replies]
            poller = zmq.Poller()
            for address in waiting:
                poller.register(self._link(address).socket, zmq.POLLIN)
            ready = dict(poller.poll(20))
            for address in waiting:
                link = self._link(address)
                if link.socket in ready:
                    self._collect(address, calls[address], replies)
        for address, reply in replies.items():
            if isinstance(reply, RefitTimeoutError):
                self._silent.add(address)
            else:
                self._silent.discard(address)
        return replies

    def _fail_gone(
        self, waiting: list[str], calls: Mapping[str, _Call], replies: dict[str, Reply]
    ) -> bool:
        """End the requests to relays whose port refuses connections (gone for good); whether
        there was one."""
        gone = [a for a in waiting if refuses_connections(a)]
        for address in gone:
            call = calls[address]
            logger.warning("relay %s: %s failed: the relay is gone", address, call.kind)
            self._link(address).reset()
            replies[address] = RefitTimeoutError(
                f"relay {address}: could not answer {call.kind}: it refuses connections "
                "(its process is dead, or the relay was closed)"
            )
        return bool(gone)

    def _advance(self, address: str, call: _Call, now: float, replies: dict[str, Reply]) -> None:
        """Send a due request without blocking; time out an overdue attempt."""
        if call.send_at and now >= call.send_at:
            if not call.until:
                call.attempt += 1
                call.until = min(now + call.reply_within_s, call.end)
            fields = {"request_id": call.request_id, **call.fields}
            try:
                if self._link(address).try_send(encode(call.kind, fields, self._signer)):
                    call.send_at = 0.0
                    return
            except RefitError as exc:
                self._retry_or_fail(address, call, now, replies, exc)
                return
        if call.until and now >= call.until:
            what = "send" if call.send_at else "answer"
            within = (
                "before the deadline"
                if call.until >= call.end
                else f"within {call.reply_within_s:.1f} s"
            )
            self._retry_or_fail(
                address,
                call,
                now,
                replies,
                RefitTimeoutError(
                    f"relay {address}: could not {what} {call.kind} {within} (dead or frozen?)"
                ),
            )

    def _retry_or_fail(
        self, address: str, call: _Call, now: float, replies: dict[str, Reply], error: RefitError
    ) -> None:
        link = self._link(address)
        link.reset()
        pause_s = self._tuning.backoff(call.attempt - 1)
        if (
            isinstance(error, AuthenticationError)
            or call.attempt > call.retries
            or now + pause_s >= call.end
        ):
            logger.warning(
                "relay %s: %s failed after %d attempts: %s", address, call.kind, call.attempt, error
            )
            replies[address] = error
            return
        logger.info(
            "relay %s: %s attempt %d failed (%s); retrying", address, call.kind, call.attempt, error
        )
        call.until = 0.0
        call.send_at = now + pause_s

    def _collect(self, address: str, call: _Call, replies: dict[str, Reply]) -> None:
        link = self._link(address)

        def ours(message: Message) -> bool:
            return (
                message.kind in (Kind.DONE, Kind.NACK)
                and message.fields.get("request_id") == call.request_id
            )

        try:
            reply = link.receive(ours, until=time.monotonic())
        except AuthenticationError as exc:
            link.reset()
            replies[address] = exc
            return
        if reply is None:
            return
        if reply.kind is Kind.DONE:
            replies[address] = reply.mapping("result")
            return
        replies[address] = error_for_nack(
            NackCode(reply.text("code")),
            reply.text("message"),
            relay=reply.text("relay"),
            what=f"{call.kind} {call.fields.get('transfer_id', '')}".strip(),
        )

    def retain(self, addresses: Collection[str]) -> None:
        """Close the links to every relay not in ``addresses`` (linger 0): a link to an
        address that left the tree would otherwise reconnect to it forever."""
        for address in [a for a in self._links if a not in addresses]:
            self._links.pop(address).close()
            self._silent.discard(address)

    def close(self) -> None:
        """Close every socket."""
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._context.term()
