"""Trainer side: one DEALER control socket per engine worker, every wait bounded by a deadline.

A worker's REP socket answers requests one at a time, in order, so a trainer may send the
next request before the previous one is answered (the next bucket is then already queued
when the worker finishes loading one: no round trip between two loads) and replies need no
ids: each is matched to the oldest outstanding request, whose ``op`` it must name. A worker
that does not answer before the refit's deadline has its socket closed with linger 0 and is
named in the :class:`~refit_core.errors.RefitTimeoutError`; the links are then broken until
rebuilt.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from refit_core import ProtocolError, RefitError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_zmq.ipc.protocol import decode, encode, error_for_reply

__all__ = ["WorkerLinks"]

logger = logging.getLogger(__name__)


def _timeout_ms(deadline: Deadline) -> int | None:
    left = deadline.remaining_s()
    return None if left is None else int(left * 1000)


class _Link:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.address = address
        self.socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.awaiting: deque[str] = deque()
        """The ops of the requests whose replies are outstanding, oldest first."""


class WorkerLinks:
    """The control sockets of ``addresses``, in order (index ``i`` is engine shard ``i``)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("no engine worker to refit")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"duplicate worker addresses in {list(addresses)}")
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._links = [_Link(self._context, address) for address in addresses]
        self.broken = False

    @property
    def addresses(self) -> list[str]:
        """The workers' control addresses."""
        return [link.address for link in self._links]

    def send(self, message: Mapping[str, Any], deadline: Deadline) -> None:
        """Send ``message`` to every worker (behind any request still awaiting its reply)."""
        frame = encode(message)
        op = str(message["op"])
        for link in self._links:
            if not link.socket.poll(_timeout_ms(deadline), zmq.POLLOUT):
                self._time_out([link], op)
            link.socket.send_multipart([b"", frame], zmq.NOBLOCK)  # b"": REP's delimiter
            link.awaiting.append(op)

    def gather(self, deadline: Deadline) -> dict[str, dict[str, Any]]:
        """The reply to every worker's oldest outstanding request, by address.

        Raises:
            RefitTimeoutError: some worker did not answer in time (its socket is closed).
            RefitError: a worker refused the request (the first refusal, typed), or a reply
                was malformed (ProtocolError); every other reply was still collected.
        """
        replies, refusal = self._collect(deadline)
        if refusal is not None:
            raise refusal
        return replies

    def _collect(self, deadline: Deadline) -> tuple[dict[str, dict[str, Any]], RefitError | None]:
        replies: dict[str, dict[str, Any]] = {}
        refusal: RefitError | None = None
        poller = zmq.Poller()
        pending = {link.socket: link for link in self._links if link.awaiting}
        for socket in pending:
            poller.register(socket, zmq.POLLIN)
        while pending:
            ready = dict(poller.poll(_timeout_ms(deadline)))
            if not ready:
                self._time_out(list(pending.values()), "reply")
            for socket in ready:
                link = pending.pop(socket)
                poller.unregister(socket)
                op = link.awaiting.popleft()
                try:
                    reply = _reply(socket.recv_multipart(zmq.NOBLOCK))
                    if reply.get("op") != op:
                        raise ProtocolError(
                            f"{link.address} answered {reply.get('op')!r} to {op!r}"
                        )
                except ProtocolError as exc:
                    refusal = refusal or exc
                    continue
                replies[link.address] = reply
                if reply.get("ok") is not True and refusal is None:
                    refusal = error_for_reply(link.address, op, reply)
        return replies, refusal

    def request(self, message: Mapping[str, Any], deadline: Deadline) -> dict[str, dict[str, Any]]:
        """Send ``message`` to every worker and gather the replies."""
        self.send(message, deadline)
        return self.gather(deadline)

    def settle(self, abort: Mapping[str, Any], deadline: Deadline) -> list[str]:
        """After a failure: drain every outstanding reply, send ``abort`` to every worker, and
        return those whose engine holds a partial load. Raises only RefitTimeoutError."""
        while any(link.awaiting for link in self._links):
            self._collect(deadline)
        self.send(abort, deadline)
        replies, _ = self._collect(deadline)
        return [address for address, reply in replies.items() if reply.get("partial") is True]

    def _time_out(self, late: list[_Link], what: str) -> None:
        for link in late:
            link.socket.close(linger=0)
        self.broken = True
        names = [link.address for link in late]
        raise RefitTimeoutError(
            f"workers {names} did not answer ({what}) within the refit's deadline",
            wedged_workers=names,
        )

    def close(self) -> None:
        """Close every socket (linger 0) and the context."""
        for link in self._links:
            link.socket.close(linger=0)
        self._context.term()


def _reply(frames: list[bytes]) -> dict[str, Any]:
    """The reply in a DEALER's frames: REP's empty delimiter, then one JSON frame."""
    if len(frames) != 2 or frames[0]:
        raise ProtocolError(f"a reply is a delimiter and one frame, got {len(frames)} frames")
    return decode(frames[1])
