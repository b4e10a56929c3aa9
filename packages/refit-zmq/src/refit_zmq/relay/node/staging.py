"""Bounded staging of payloads on a relay: admission by byte budget, chunks kept as received.

A chunk is never copied here: the payload keeps the received frame's memory until it is
applied locally and streamed to every child, and those read the same memory. Frame 0 (the
payload's head) is read as it arrives, so that a chunk holding bytes of two frames is refused
when it arrives rather than after the payload's last byte.

A payload is admitted (its BEGIN answered READY) only when its whole size fits the budget
and its tree has a free slot in the window, so every chunk of an admitted payload always has
room and the relay never has to stop reading half-way through one. BEGINs that do not fit
wait in a bounded queue, first come first served; beyond it they are answered BUSY.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from refit_core import ProtocolError
from refit_zmq.codec import PRELUDE_BYTES, head_length, read_layout
from refit_zmq.relay.apply.payload_stream import check_chunks, frame_ends

__all__ = ["PayloadKey", "Pending", "StagedPayload", "Staging"]

_RELEASED = memoryview(b"")

PayloadKey = tuple[str, str, str]
"""``(transfer_id, producer_id, payload_id)``."""


@dataclass(eq=False)
class StagedPayload:
    """One admitted payload: the chunks received (in arrival order), its fate.

    Attributes:
        key: transfer, producer and payload id.
        checksum: the declared xxh3-128.
        root: the relay at the root of the tree carrying it.
        begin: the BEGIN fields children get (checksum, versions, candidates, hops).
        route: ROUTER identity of the last sender, for the ACK.
        chunks: ``(offset, length)`` of every chunk, in arrival order (what forwards stream).
        applied: whether the local apply has finished (either way).
        forwards: children still being streamed to.
        frame_ends: where every frame ends (payload offsets), once frame 0 arrived and its
            layout accounts for exactly ``total_bytes``; None before, or for a head that does
            not (corrupted bytes: the receiver reports those after the last byte).
    """

    key: PayloadKey
    checksum: str
    total_bytes: int
    root: str
    begin: dict[str, Any]
    route: bytes
    chunks: list[tuple[int, int]] = field(default_factory=list)
    received: int = 0
    applied: bool = False
    forwards: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    _views: list[memoryview] = field(default_factory=list)
    _by_offset: dict[int, tuple[int, memoryview]] = field(default_factory=dict)
    _starts: list[int] = field(default_factory=list)
    _ends: list[int] = field(default_factory=list)
    frame_ends: list[int] | None = None
    _head: bytearray | None = field(default_factory=bytearray)

    @property
    def complete(self) -> bool:
        """Whether every byte has arrived."""
        return self.received == self.total_bytes

    @property
    def done(self) -> bool:
        """Applied locally and streamed to every child: its bytes can go."""
        return self.applied and self.forwards == 0

    def write(self, offset: int, data: memoryview) -> bool:
        """Store a chunk; False when it repeats one already held (a retry).

        Raises:
            ProtocolError: the chunk overlaps another one differently, or holds bytes of two
                frames (as far as frame 0, once arrived, tells).
        """
        end = offset + len(data)
        if end > self.total_bytes:
            raise ProtocolError("chunk runs past the payload's end")
        at = bisect.bisect_right(self._starts, offset)
        if at and self._starts[at - 1] == offset and self._ends[at - 1] == end:
            return False
        if (at and self._ends[at - 1] > offset) or (
            at < len(self._starts) and self._starts[at] < end
        ):
            raise ProtocolError(f"chunk [{offset}, {end}) overlaps another chunk")
        self._starts.insert(at, offset)
        self._ends.insert(at, end)
        self.chunks.append((offset, len(data)))
        self._by_offset[offset] = (len(self._views), data)
        self._views.append(data)
        self.received += len(data)
        self.last_seen = time.monotonic()
        if self.frame_ends is None:
            self._read_head(offset, data)
        else:
            check_chunks(self.frame_ends, [(offset, len(data))])
        return True

    def _read_head(self, offset: int, data: memoryview) -> None:
        """Collect frame 0 from the chunks that continue it; once whole, learn every frame's
        end and check the chunks so far against them."""
        head = self._head
        if head is None or offset != len(head):
            return
        head += data
        try:
            if len(head) < PRELUDE_BYTES or len(head) < (size := head_length(head)):
                return
            ends = frame_ends(read_layout(memoryview(head)[:size]))
        except ProtocolError:
            ends = []
        self._head = None
        if ends and ends[-1] == self.total_bytes:
            self.frame_ends = ends
            check_chunks(ends, self.chunks)

    def chunk(self, index: int) -> memoryview:
        """The bytes of chunk number ``index`` (arrival order)."""
        return self._views[index]

    def at(self, offset: int) -> memoryview | None:
        """The chunk starting at ``offset``, if it has arrived (and is still held)."""
        held = self._by_offset.get(offset)
        return None if held is None else held[1]

    def handed_over(self, offset: int) -> None:
        """The receiver took the chunk at ``offset``: let its memory go unless a child still
        has to be sent it (received memory reused soon is warm; held long, it is not)."""
        if self.forwards == 0:
            index, _ = self._by_offset.pop(offset)
            self._views[index] = _RELEASED

    def joined(self) -> bytes:
        """The whole payload as one buffer (copies; call once it is complete)."""
        return b"".join(self._by_offset[start][1] for start in self._starts)


@dataclass(eq=False)
class Pending:
    """A BEGIN waiting for room."""

    key: PayloadKey
    total_bytes: int
    root: str
    fields: dict[str, Any]
    route: bytes
    since: float = field(default_factory=time.monotonic)
    noticed: float = field(default_factory=time.monotonic)


class Staging:
    """The payloads a relay holds, within ``budget_bytes`` and ``window`` per tree."""

    def __init__(self, *, budget_bytes: int, window: int, max_pending: int) -> None:
        self.budget_bytes = budget_bytes
        self._window = window
        self._max_pending = max_pending
        self.staged: dict[PayloadKey, StagedPayload] = {}
        self.pending: deque[Pending] = deque()
        self.reserved_bytes = 0
        self.peak_bytes = 0
        self._per_root: Counter[str] = Counter()

    def fits(self, total_bytes: int, root: str) -> bool:
        """Whether a payload of ``total_bytes`` in the tree of ``root`` can be admitted now."""
        return (
            self.reserved_bytes + total_bytes <= self.budget_bytes
            and self._per_root[root] < self._window
        )

    def admit(self, staged: StagedPayload) -> None:
        """Take ``staged`` in (its size must fit)."""
        self.staged[staged.key] = staged
        self.reserved_bytes += staged.total_bytes
        self.peak_bytes = max(self.peak_bytes, self.reserved_bytes)
        self._per_root[staged.root] += 1

    def release(self, staged: StagedPayload) -> None:
        """Let ``staged`` go (idempotent)."""
        if self.staged.pop(staged.key, None) is staged:
            self.reserved_bytes -= staged.total_bytes
            self._per_root[staged.root] -= 1

    def queued(self, key: PayloadKey) -> bool:
        """Whether a BEGIN of ``key`` waits for room."""
        return any(pending.key == key for pending in self.pending)

    def wait(self, pending: Pending) -> bool:
        """Queue a BEGIN for room; False when the queue is full (answer BUSY)."""
        for queued in self.pending:
            if queued.key == pending.key:
                queued.route = pending.route
                return True
        if len(self.pending) >= self._max_pending:
            return False
        self.pending.append(pending)
        return True

    def admissible(self) -> list[Pending]:
        """Queued BEGINs that fit now, oldest first, taken off the queue.

        The oldest BEGIN that does not fit the byte budget blocks the ones behind it (no
        starvation of large payloads); one blocked only by its tree's window does not.
        """
        taken: list[Pending] = []
        reserved = self.reserved_bytes
        per_root = Counter(self._per_root)
        for pending in list(self.pending):
            if reserved + pending.total_bytes > self.budget_bytes:
                break
            if per_root[pending.root] >= self._window:
                continue
            self.pending.remove(pending)
            taken.append(pending)
            reserved += pending.total_bytes
            per_root[pending.root] += 1
        return taken

    def of_transfer(self, transfer_id: str) -> list[StagedPayload]:
        """Staged payloads of a transfer."""
        return [s for s in self.staged.values() if s.key[0] == transfer_id]

    def drop_pending(self, transfer_id: str) -> list[Pending]:
        """Take the queued BEGINs of ``transfer_id`` off the queue."""
        dropped = [p for p in self.pending if p.key[0] == transfer_id]
        for pending in dropped:
            self.pending.remove(pending)
        return dropped

    def idle(
        self, now: float, timeout_s: float, queue_s: float
    ) -> tuple[list[StagedPayload], list[Pending]]:
        """Payloads without a chunk for ``timeout_s``, and BEGINs queued for ``queue_s`` (taken
        off the queue)."""
        stalled = [
            s for s in self.staged.values() if not s.complete and now - s.last_seen > timeout_s
        ]
        expired = [p for p in self.pending if now - p.since > queue_s]
        for pending in expired:
            self.pending.remove(pending)
        return stalled, expired
