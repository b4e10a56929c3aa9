"""FLUSH over a relay's whole subtree: its own report, then its children's, recursively.

A relay answers a FLUSH with ``subtree`` set once its own transfer settled (every payload
applied here and acknowledged by each child), then asks every child it forwarded to for a
subtree FLUSH of the payloads it sent there, and answers with one report per relay. The
children are asked from a worker thread (their answers may take the whole wait), whose result
is handed back to the event loop like a receiver job's.

The whole subtree answers within the request's ``wait_s``: a relay gives each child
:data:`CHILD_SHARE` of what is left of its own budget, and waits for the child's answer no
longer than the rest, without retries. So a silent relay is reported UNREACHABLE by its own
parent, before that parent's budget (and its ancestors') runs out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.control import ControlChannel, Reply
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.frames import Kind
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["CHILD_SHARE", "Respond", "SubtreeFlush"]

logger = logging.getLogger(__name__)

Respond = Callable[[dict[str, Any]], None]
"""Gets a FLUSH answer's ``result``."""

CHILD_SHARE = 0.75
"""The part of a relay's remaining budget its children get for their own subtrees."""


class SubtreeFlush:
    """Gathers the flush reports of a relay's subtree.

    Args:
        signer: the relay's API key signer (children share the key).
        curve: the relays' CURVE key, when they encrypt.
        tuning: high-water marks (children are asked once: see the module docstring).
        wake: wakes the relay's event loop (a child's answer arrived).
    """

    def __init__(
        self,
        *,
        signer: Signer,
        curve: CurveConfig | None,
        tuning: RelayTuning,
        wake: Callable[[], None],
    ) -> None:
        once = dataclasses.replace(tuning, retries=0)
        self._channel = ControlChannel(signer=signer, curve=curve, tuning=once)
        self._jobs = ReceiverJobs(wake, name="subtree-flush")

    def gather(self, own: str, report: dict[str, Any], deadline: float, respond: Respond) -> None:
        """Call ``respond({"relays": {address: report}})`` for ``own`` and its subtree.

        Args:
            own: this relay's address.
            report: this relay's settled flush report.
            deadline: the ``time.monotonic()`` by which this relay must answer.
            respond: gets the merged reports, on the event loop.
        """
        sent = {
            child: int(counts["forwarded"])
            for child, counts in report["children"].items()
            if counts["forwarded"]
        }
        if not sent:
            respond({"relays": {own: report}})
            return
        left_s = max(0.0, deadline - time.monotonic())
        requests = {
            child: (
                Kind.FLUSH,
                {
                    "transfer_id": report["transfer_id"],
                    "expected_payloads": payloads,
                    "wait_s": CHILD_SHARE * left_s,
                    "subtree": True,
                },
            )
            for child, payloads in sent.items()
        }

        def ask() -> dict[str, Reply]:
            return self._channel.call(requests, reply_within_s=left_s)

        def merge(future: Future[dict[str, Reply]]) -> None:
            relays = {own: report}
            error = future.exception()
            replies: dict[str, Reply] = {} if error is not None else future.result()
            for child in sent:
                reply = replies.get(child)
                if isinstance(reply, dict):
                    relays.update(reply["relays"])
                else:
                    relays[child] = _unreachable(child, report["transfer_id"], reply or error)
            respond({"relays": relays})

        self._jobs.submit(ask, merge)

    def finish(self) -> None:
        """Hand finished subtree answers to their responders (on the event loop)."""
        self._jobs.finish()

    def close(self) -> None:
        """Wait for a running request; close the sockets."""
        self._jobs.close()
        self._channel.close()


def _unreachable(child: str, transfer_id: str, error: BaseException | None) -> dict[str, Any]:
    """The report standing in for a child that did not answer its subtree FLUSH."""
    logger.warning("subtree flush: child %s did not report: %s", child, error)
    return {
        "relay": child,
        "transfer_id": transfer_id,
        "state": "unknown",
        "complete": False,
        "failures": [{"relay": child, "code": "UNREACHABLE", "message": str(error)}],
    }
