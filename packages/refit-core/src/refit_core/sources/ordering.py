"""The ordering guard between a sharded source's gathers and its consumer's collectives.

Collectives on the same ranks must be issued in the same order on every rank, or they
deadlock. A sharded source therefore alternates strictly, on every rank::

    gather(bucket 0), consumer collectives on bucket 0, gather(bucket 1), ...

The source completes every gather of a bucket before it yields the bucket, so no gather is
in flight while the consumer holds it; the consumer runs its collectives (a broadcast to an
engine, a send to a peer) between yields, inside :meth:`CollectiveOrderGuard.consumer_turn`.
A violation raises :class:`CollectiveOrderError` at once on the rank that commits it instead
of waiting: waiting would let each rank's thread timing pick the order, which is how
concurrent collectives deadlock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from refit_core.errors import RefitError

__all__ = ["CollectiveOrderError", "CollectiveOrderGuard"]


class CollectiveOrderError(RefitError, RuntimeError):
    """A gather and another collective overlapped on one rank (a usage error, not retryable)."""


class CollectiveOrderGuard:
    """Refuses any overlap of a source's gathers with its consumer's collectives on one rank.

    Thread safe. Consumer turns may nest and run on several threads at once; a gather may not
    overlap any consumer turn or another gather.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gathering = False
        self._consumer_turns = 0

    @contextmanager
    def gather(self) -> Iterator[None]:
        """Held by the source while it gathers one bucket (entered when the iterator resumes)."""
        with self._lock:
            if self._gathering:
                raise CollectiveOrderError("two gathers overlap on this rank")
            if self._consumer_turns:
                raise CollectiveOrderError(
                    "the source was resumed while a consumer collective is still running; "
                    "finish each bucket's collectives before asking for the next bucket"
                )
            self._gathering = True
        try:
            yield
        finally:
            with self._lock:
                self._gathering = False

    @contextmanager
    def consumer_turn(self) -> Iterator[None]:
        """Held by the consumer around each collective it runs on the source's ranks."""
        with self._lock:
            if self._gathering:
                raise CollectiveOrderError(
                    "a consumer collective started while the source is gathering; run it "
                    "between yields, on the bucket just yielded"
                )
            self._consumer_turns += 1
        try:
            yield
        finally:
            with self._lock:
                self._consumer_turns -= 1
