"""A relay's local apply: staged payloads go to its receiver in admission order, as they arrive.

A :class:`~refit_zmq.relay.apply.receiver.StreamingReceiver` gets each payload's chunks while they
come in, in payload order, one payload after the other (so the undo data of payloads that
overlap stays in write order), and finishes a payload once its last byte was fed. Any other
receiver gets each payload whole through ``apply``. Every receiver call runs on the receiver
thread; the calls that only feed bytes are not waited for, the finishing one hands its result
to ``applied`` on the event loop.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from refit_zmq.codec import PRELUDE_BYTES, head_length, read_layout
from refit_zmq.relay.apply.payload_stream import check_chunks, frame_ends
from refit_zmq.relay.apply.receiver import PayloadSink, Receiver, StreamingReceiver
from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.node.replies import payload_ids
from refit_zmq.relay.node.staging import StagedPayload
from refit_zmq.relay.wire.reports import ApplyResult

__all__ = ["Applied", "LocalApply"]

Job = Callable[[], tuple[ApplyResult, float]]
"""A receiver call that applies a payload: its result and the seconds it took."""

Applied = Callable[[StagedPayload, Future[tuple[ApplyResult, float]]], None]
"""Called on the event loop with a payload and its job's future."""


class _Sink:
    """The receiver's sink for one payload, opened on the receiver thread, timed there."""

    def __init__(self, receiver: StreamingReceiver, metadata: dict[str, Any]) -> None:
        self._receiver = receiver
        self._metadata = metadata
        self._sink: PayloadSink | None = None
        self.seconds = 0.0

    def open(self) -> None:
        started = time.perf_counter()
        self._sink = self._receiver.open_payload(self._metadata)
        self.seconds += time.perf_counter() - started

    def feed(self, chunk: memoryview) -> None:
        assert self._sink is not None
        started = time.perf_counter()
        self._sink.feed(chunk)
        self.seconds += time.perf_counter() - started

    def finish(self) -> tuple[ApplyResult, float]:
        assert self._sink is not None
        started = time.perf_counter()
        result = self._sink.finish()
        return result, self.seconds + time.perf_counter() - started

    def abandon(self) -> None:
        if self._sink is not None:
            self._sink.abandon()


def _applied_whole(
    receiver: Receiver, staged: StagedPayload, metadata: dict[str, Any]
) -> tuple[ApplyResult, float]:
    """Join the payload's chunks, check that none held bytes of two frames, and apply it (on
    the receiver thread: the join copies)."""
    started = time.perf_counter()
    body = memoryview(staged.joined())
    head = body[: head_length(body[:PRELUDE_BYTES])]
    check_chunks(frame_ends(read_layout(head)), staged.chunks)
    result = receiver.apply(body, metadata)
    return result, time.perf_counter() - started


class LocalApply:
    """Hands staged payloads to the receiver in admission order (see the module docstring)."""

    def __init__(self, receiver: Receiver, jobs: ReceiverJobs, applied: Applied) -> None:
        self._receiver = receiver
        self._streaming = receiver if isinstance(receiver, StreamingReceiver) else None
        self._jobs = jobs
        self._applied = applied
        self._queue: deque[StagedPayload] = deque()
        self._fed: dict[StagedPayload, int] = {}
        self._sinks: dict[StagedPayload, _Sink] = {}

    def add(self, staged: StagedPayload) -> None:
        """Queue an admitted payload, then pass on whatever can go."""
        self._queue.append(staged)
        self.pump()

    def pump(self) -> None:
        """Feed the chunks that arrived in order; finish every payload whose bytes are all in."""
        while self._queue:
            staged = self._queue[0]
            finish = self._streamed(staged) if self._streaming else self._whole(staged)
            if finish is None:
                return
            self._jobs.submit(finish, functools.partial(self._applied, staged))
            self._queue.popleft()

    def _whole(self, staged: StagedPayload) -> Job | None:
        """The apply of a complete payload (None: not complete yet)."""
        if not staged.complete:
            return None
        return functools.partial(_applied_whole, self._receiver, staged, _metadata(staged))

    def _streamed(self, staged: StagedPayload) -> Job | None:
        """Feed the chunks that continue what was fed; the finish once every byte was fed."""
        assert self._streaming is not None
        sink = self._sinks.get(staged)
        if sink is None:
            sink = self._sinks[staged] = _Sink(self._streaming, _metadata(staged))
            self._fed[staged] = 0
            self._jobs.run(sink.open)
        fed = self._fed[staged]
        while (chunk := staged.at(fed)) is not None:
            self._jobs.run(functools.partial(sink.feed, chunk))
            staged.handed_over(fed)
            fed += len(chunk)
        self._fed[staged] = fed
        if fed < staged.total_bytes:
            return None
        del self._fed[staged], self._sinks[staged]
        return sink.finish

    def drop(self, staged: StagedPayload) -> None:
        """Forget a payload that will not be finished; undo what its sink wrote."""
        if staged in self._queue:
            self._queue.remove(staged)
        self._fed.pop(staged, None)
        sink = self._sinks.pop(staged, None)
        if sink is not None:
            self._jobs.run(sink.abandon)
        self.pump()


def _metadata(staged: StagedPayload) -> dict[str, Any]:
    return {**staged.begin, **payload_ids(staged.key)}
