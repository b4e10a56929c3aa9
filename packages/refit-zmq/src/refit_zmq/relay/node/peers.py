"""Requests a relay sends to other relays (subtree flushes, outcome questions), off its loop.

A relay's event loop never waits on another relay: each batch of requests runs on a worker
thread through a :class:`~refit_zmq.relay.wire.control.ControlChannel` that sends every
request once (no retries: the asker decides when to ask again), and its replies are handed
back to the event loop like a receiver job's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from refit_core import RefitError
from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.control import ControlChannel, Reply
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.frames import Kind
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["Answers", "PeerRequests"]

Answers = Callable[[dict[str, Reply]], None]
"""Gets relay -> its DONE result or the error its request ended in, on the event loop."""


class PeerRequests:
    """Control requests to other relays, sent from a worker thread, answered on the loop.

    Args:
        signer: the relay's API key signer (relays share the key).
        curve: the relays' CURVE key, when they encrypt.
        tuning: high-water marks and link settings (requests are sent once).
        wake: wakes the relay's event loop (an answer arrived).
        name: names the worker thread.
    """

    def __init__(
        self,
        *,
        signer: Signer,
        curve: CurveConfig | None,
        tuning: RelayTuning,
        wake: Callable[[], None],
        name: str,
    ) -> None:
        once = dataclasses.replace(tuning, retries=0)
        self._channel = ControlChannel(signer=signer, curve=curve, tuning=once)
        self._jobs = ReceiverJobs(wake, name=name)

    def send(
        self,
        requests: Mapping[str, tuple[Kind, dict[str, Any]]],
        *,
        within_s: float,
        then: Answers,
    ) -> None:
        """Send ``requests`` (relay -> (kind, fields)); ``then(replies)`` on the loop, within
        ``within_s`` (a relay that did not answer by then maps to its error)."""

        def ask() -> dict[str, Reply]:
            return self._channel.call(requests, reply_within_s=within_s)

        def answered(future: Future[dict[str, Reply]]) -> None:
            error = future.exception()
            if error is None:
                then(future.result())
            else:
                failed = RefitError(f"request failed: {type(error).__name__}: {error}")
                then(dict.fromkeys(requests, failed))

        self._jobs.submit(ask, answered)

    def finish(self) -> None:
        """Hand finished answers to their continuations (on the event loop)."""
        self._jobs.finish()

    def close(self) -> None:
        """Wait for a running batch; close the sockets."""
        self._jobs.close()
        self._channel.close()
