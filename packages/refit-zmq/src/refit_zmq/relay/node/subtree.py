"""FLUSH over a relay's whole subtree: its own report, then its children's, recursively.

A relay answers a FLUSH with ``subtree`` set once its own transfer settled (every payload
applied here and acknowledged by each child), then asks every child it forwarded to for a
subtree FLUSH of the payloads it sent there, and answers with one report per relay.

The whole subtree answers within the request's ``wait_s``: a relay gives each child
:data:`CHILD_SHARE` of what is left of its own budget, and waits for the child's answer no
longer than the rest, without retries. So a silent relay is reported UNREACHABLE by its own
parent, before that parent's budget (and its ancestors') runs out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from refit_core import ProtocolError, RefitError
from refit_zmq.relay.node.peers import PeerRequests
from refit_zmq.relay.wire.control import Reply
from refit_zmq.relay.wire.frames import Kind
from refit_zmq.relay.wire.reports import (
    Failure,
    FlushReport,
    SubtreeReport,
    TransferState,
)

__all__ = ["CHILD_SHARE", "SubtreeFlush"]

logger = logging.getLogger(__name__)

CHILD_SHARE = 0.75
"""The part of a relay's remaining budget its children get for their own subtrees."""


class SubtreeFlush:
    """Gathers the flush reports of a relay's subtree (through ``peers``)."""

    def __init__(self, peers: PeerRequests) -> None:
        self._peers = peers

    def gather(
        self,
        own: str,
        report: FlushReport,
        deadline: float,
        respond: Callable[[SubtreeReport], None],
    ) -> None:
        """Call ``respond`` with the reports of ``own`` and its subtree.

        Args:
            own: this relay's address.
            report: this relay's settled flush report.
            deadline: the ``time.monotonic()`` by which this relay must answer.
            respond: gets the merged reports, on the event loop.
        """
        sent = {child: c.forwarded for child, c in report.children.items() if c.forwarded}
        if not sent:
            respond(SubtreeReport({own: report}))
            return
        left_s = max(0.0, deadline - time.monotonic())
        requests = {
            child: (
                Kind.FLUSH,
                {
                    "transfer_id": report.transfer_id,
                    "expected_payloads": payloads,
                    "wait_s": CHILD_SHARE * left_s,
                    "subtree": True,
                },
            )
            for child, payloads in sent.items()
        }

        def merge(replies: dict[str, Reply]) -> None:
            relays = {own: report}
            for child in sent:
                reply = replies.get(child)
                try:
                    if isinstance(reply, dict):
                        relays.update(SubtreeReport.from_json(reply).relays)
                        continue
                except ProtocolError as exc:
                    reply = exc
                relays[child] = _unreachable(child, report.transfer_id, reply)
            respond(SubtreeReport(relays))

        self._peers.send(requests, within_s=left_s, then=merge)


def _unreachable(child: str, transfer_id: str, error: RefitError | None) -> FlushReport:
    """The report standing in for a child that did not answer its subtree FLUSH."""
    logger.warning("subtree flush: child %s did not report: %s", child, error)
    return FlushReport(
        relay=child,
        transfer_id=transfer_id,
        state=TransferState.UNKNOWN,
        complete=False,
        expected=0,
        applied=0,
        duplicates=0,
        bytes_received=0,
        bytes_forwarded=0,
        apply_s=0.0,
        elapsed_s=0.0,
        version=None,
        failures=(Failure(child, "UNREACHABLE", str(error)),),
    )
