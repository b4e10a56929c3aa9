"""Apply one payload while its bytes arrive, in order, with undo data and a read-back sample.

A relay receives a payload as chunks. Rather than stage it whole and then apply it, a
:class:`PayloadStream` takes each chunk as it comes, block by block: it hashes a block (the
payload checksum), and writes the bytes of dense and range items straight from it into the
receiver's tensor after copying the bits they overwrite into its undo log, while the block
is still in cache.
Items stored otherwise (compressed, sparse locations, non-contiguous or device tensors) are
gathered and applied by the codec as soon as all their buffers are in. Frame 0 is parsed and
every item checked (names, shapes, dtypes, base version, the receiver's own rules) before the
first write, so a payload for the wrong model or version touches nothing. The checksum can
only be known at the end: a payload whose bytes differ from its checksum is rolled back from
its undo log, bit for bit, before the error is raised, as is a payload that fails in any other
way. While a payload streams, the tensors hold a mix of its bits and the old ones, as they do
during any in-place transfer, until the transfer is committed or rolled back.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from refit_core import ChecksumMismatchError, ProtocolError, WeightVersion
from refit_zmq.codec import (
    PRELUDE_BYTES,
    BufferCodec,
    DecodedItem,
    DecodedPayload,
    Encoding,
    ItemHeader,
    PayloadHasher,
    PayloadLayout,
    StoredBuffer,
    UndoEntry,
    UndoLog,
    apply_payload,
    carried_checksum,
    check_item,
    head_length,
    read_layout,
    unpack_buffer,
)
from refit_zmq.codec.dtypes import int_view, unsigned_numpy_dtype
from refit_zmq.relay.apply.verify import check_held, draw_picks, entry_positions

__all__ = ["ByteViews", "PayloadStream", "StreamResult", "check_chunks", "frame_ends"]

BLOCK_BYTES = 256 * 1024
"""A chunk is hashed and written in blocks of this size: each block is still in the core's
cache when it is written and its old bits are copied out (a receiver's apply of 256 MiB of
dense payloads in 4 MiB chunks, one process: 119 ms whole chunks, 102 ms in 256 KiB blocks).
The Python work is per run of undo memory, not per block: one undo entry per run (blocks of
the arena) instead of one per block took the same apply from 1.26-1.35x to 1.19-1.25x the
time of a bare receiver doing the same copies and hash (3 interleaved runs, loaded machine)."""

Admit = Callable[[PayloadLayout], object]
"""Called with a payload's layout before its first write; raises to refuse the payload."""


def frame_ends(layout: PayloadLayout) -> list[int]:
    """Where each frame of a payload ends, in payload offsets (frame 0, then each buffer)."""
    ends = [layout.head_bytes]
    for info in layout.buffers:
        ends.append(ends[-1] + info.stored_bytes)
    return ends


def check_chunks(ends: list[int], chunks: Iterable[tuple[int, int]]) -> None:
    """Refuse a chunk (``(offset, length)``) that holds bytes of two frames.

    Raises:
        ProtocolError: a chunk crosses the end of a frame.
    """
    for start, length in chunks:
        inside = bisect.bisect_right(ends, start)
        if inside < len(ends) and ends[inside] < start + length:
            raise ProtocolError(
                f"chunk [{start}, {start + length}) crosses the end of a frame at "
                f"{ends[inside]} (a chunk never holds bytes of two frames)"
            )


class ByteViews:
    """The bytes of contiguous CPU tensors as flat uint8 views (torch and numpy, sharing the
    tensor's memory), made once per tensor: what chunks are written into."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._views: dict[str, tuple[torch.Tensor, np.ndarray] | None] = {}

    def get(self, name: str) -> tuple[torch.Tensor, np.ndarray] | None:
        """The views of tensor ``name``; None if it is on a device or not contiguous."""
        if name not in self._views:
            tensor = self._tensors[name]
            views = None
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                flat = int_view(tensor.detach()).reshape(-1).view(torch.uint8)
                views = (flat, flat.numpy())
            self._views[name] = views
        return self._views[name]


@dataclass(frozen=True)
class StreamResult:
    """What one streamed payload did: its items, its size, the entries read back."""

    items: tuple[ItemHeader, ...]
    nbytes: int
    verified: int


@dataclass
class _Direct:
    """A raw values buffer written straight into a contiguous CPU tensor's bytes.

    ``samples`` are the byte offsets (in the buffer) of the entries to read back, ``sent``
    collects their bytes as they pass.
    """

    item: ItemHeader
    flat: torch.Tensor
    target: np.ndarray
    origin: int
    samples: list[int]
    sent: np.ndarray


@dataclass
class _Gathered:
    """An item whose buffers are collected whole, then applied by the codec."""

    item: ItemHeader
    buffers: tuple[int, ...]
    picks: np.ndarray
    missing: int
    data: dict[int, bytearray] = field(default_factory=dict)


@dataclass(frozen=True)
class _Region:
    """Where a buffer lies in the payload and who consumes it."""

    start: int
    end: int
    buffer: int
    owner: _Direct | _Gathered


@dataclass(frozen=True)
class _Check:
    """A read-back to make once every write is done: held bits at ``positions`` vs ``sent``."""

    name: str
    tensor: torch.Tensor
    positions: np.ndarray
    sent: np.ndarray


class PayloadStream:
    """One payload applied chunk by chunk (see the module docstring). Not thread-safe.

    Args:
        tensors: name -> tensor the payload writes.
        current: the version the tensors hold (a delta item needs it as its base).
        admit: the receiver's own check of the layout, before the first write.
        candidates: entries to read back after the last write (0: none).
        rng: draws those entries.
        views: byte views of ``tensors`` (shared between the streams of one receiver).
        undo_memory: gives host memory (uint8, at least one byte and at most the asked size)
            for undo copies of the bits written straight from chunks.
        chunked: each :meth:`feed` is one received chunk, which must not hold bytes of two
            frames (False: the bytes come in any pieces, for example the payload whole).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        current: WeightVersion | None,
        *,
        admit: Admit,
        candidates: int,
        rng: np.random.Generator,
        views: ByteViews | None = None,
        undo_memory: Callable[[int], np.ndarray] = lambda nbytes: np.empty(nbytes, np.uint8),
        chunked: bool = True,
    ) -> None:
        self.undo = UndoLog()
        self._chunked = chunked
        self._undo_memory = undo_memory
        self._views = ByteViews(tensors) if views is None else views
        self._tensors = tensors
        self._current = current
        self._admit = admit
        self._candidates = candidates
        self._rng = rng
        self._hasher = PayloadHasher()
        self._head = bytearray()
        self._layout: PayloadLayout | None = None
        self._regions: list[_Region] = []
        self._starts: list[int] = []
        self._checks: list[_Check] = []
        self._at = 0
        self._fed = 0
        self._total = 0
        self._error: BaseException | None = None
        self._done = False
        self._unchecked: list[tuple[int, int]] = []
        self._ends: list[int] | None = None

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` or :meth:`abandon` was called."""
        return self._done

    def feed(self, chunk: memoryview | bytes) -> None:
        """Take the payload's next bytes. Never raises: a failure undoes what this payload
        wrote, and :meth:`finish` raises it (the bytes after it are still hashed, so that a
        corrupted payload is reported as such whatever its corruption broke first)."""
        if self._done:
            return
        view = memoryview(chunk).cast("B")
        start = self._fed
        self._fed += len(view)
        if self._error is None:
            try:
                self._take(view)
                return
            except Exception as exc:
                self._error = exc
                self.undo.restore()
        rest = view[max(0, self._hasher.offset - start) :]
        if self._total:
            rest = rest[: max(0, self._total - self._hasher.offset)]
        self._hasher.update(rest)

    def finish(self, checksum: str) -> StreamResult:
        """Check the payload is whole and is what ``checksum`` (hex xxh3-128) names, then read
        the sample back; on any failure undo this payload and raise.

        Raises:
            ChecksumMismatchError: the bytes differ from the declared or carried checksum.
            VerificationError: a re-read entry differs from the value sent.
            ProtocolError, GeometryMismatchError, StaleBaseError: as the codec's apply.
        """
        if self._done:
            raise RuntimeError("payload stream already finished")
        self._done = True
        if self._error is not None:
            corrupt = self._checksum_error(checksum)
            if corrupt is not None:
                raise corrupt from self._error
            raise self._error
        try:
            layout = self._layout
            if layout is None or self._at != layout.total_bytes:
                raise ProtocolError(f"payload ended after {self._at} bytes, before its end")
            corrupt = self._checksum_error(checksum)
            if corrupt is not None:
                raise corrupt
            verified = sum(check_held(c.name, c.tensor, c.positions, c.sent) for c in self._checks)
        except BaseException:
            self.undo.restore()
            raise
        return StreamResult(tuple(item for item, _ in layout.items), self._at, verified)

    def _checksum_error(self, checksum: str) -> ChecksumMismatchError | None:
        """The error for bytes that are not what the payload carries or was declared as."""
        if len(self._head) < PRELUDE_BYTES:
            return None
        digest = self._hasher.digest()
        if digest != carried_checksum(self._head):
            return ChecksumMismatchError("payload bytes differ from their checksum; undone")
        if digest.hex() != checksum:
            return ChecksumMismatchError("payload checksum differs from the declared one; undone")
        return None

    def abandon(self) -> None:
        """Undo whatever this payload wrote (it will never be finished); after
        :meth:`finish`, nothing (a kept payload's undo data belongs to its transfer)."""
        if not self._done:
            self._done = True
            self.undo.restore()

    # -- bytes in ------------------------------------------------------------------------

    def _take(self, view: memoryview) -> None:
        if self._chunked:
            chunk = (self._at, len(view))
            if self._ends is None:
                self._unchecked.append(chunk)
            else:
                check_chunks(self._ends, (chunk,))
        if self._layout is None:
            view = self._take_head(view)
            if self._layout is None:
                return
        if self._at + len(view) > self._total:
            self._hasher.update(view[: self._total - self._at])
            raise ProtocolError(f"payload bytes run past its end ({self._total})")
        start = self._at
        end = start + len(view)
        hashed = start
        index = max(0, bisect.bisect_right(self._starts, start) - 1)
        while index < len(self._regions) and self._regions[index].start < end:
            region = self._regions[index]
            lo, hi = max(start, region.start), min(end, region.end)
            if lo < hi:
                self._hasher.update(view[hashed - start : lo - start])
                self._consume(region, lo - region.start, view[lo - start : hi - start])
                hashed = hi
            index += 1
        self._hasher.update(view[hashed - start :])
        self._at = end

    def _take_head(self, view: memoryview) -> memoryview:
        """Collect frame 0; once whole, plan the payload; return the bytes after it."""
        if len(self._head) < PRELUDE_BYTES:
            view = self._collect_head(view, PRELUDE_BYTES - len(self._head))
            if len(self._head) < PRELUDE_BYTES:
                return view
        view = self._collect_head(view, head_length(self._head) - len(self._head))
        if len(self._head) == head_length(self._head):
            self._plan(read_layout(self._head))
        return view

    def _collect_head(self, view: memoryview, need: int) -> memoryview:
        taken = view[:need]
        self._hasher.update(taken)
        self._head += taken
        self._at += len(taken)
        return view[len(taken) :]

    def _plan(self, layout: PayloadLayout) -> None:
        """Check every item, then map each buffer to the item that consumes it."""
        self._total = layout.total_bytes
        for item, _ in layout.items:
            check_item(item, self._tensors, self._current)
        self._admit(layout)
        carrying = [(item, own) for item, own in layout.items if own and item.count]
        picks = draw_picks([item.count for item, _ in carrying], self._candidates, self._rng)
        at = layout.head_bytes
        bounds = []
        for info in layout.buffers:
            bounds.append((at, at + info.stored_bytes))
            at += info.stored_bytes
        for (item, own), chosen in zip(carrying, picks, strict=True):
            planes = layout.buffers[own[-1]].planes
            views = self._views.get(item.name)
            if (
                item.encoding in (Encoding.DENSE, Encoding.RANGE)
                and planes[0].codec is BufferCodec.RAW
                and len(planes) == 1
                and views is not None
            ):
                owner: _Direct | _Gathered = self._direct(item, views, chosen)
            else:
                filled = sum(1 for b in own if layout.buffers[b].stored_bytes)
                owner = _Gathered(item, own, chosen, missing=filled)
            for buffer in own:
                start, end = bounds[buffer]
                if end > start:
                    self._regions.append(_Region(start, end, buffer, owner))
        self._regions.sort(key=lambda region: region.start)
        self._starts = [region.start for region in self._regions]
        self._layout = layout
        self._ends = frame_ends(layout)
        check_chunks(self._ends, self._unchecked)
        self._unchecked.clear()

    def _direct(
        self, item: ItemHeader, views: tuple[torch.Tensor, np.ndarray], picks: np.ndarray
    ) -> _Direct:
        size = item.itemsize
        origin = (item.span_start + item.first) * size
        samples = [int(p) * size for p in picks]
        sent = np.zeros(len(samples) * size, np.uint8)
        direct = _Direct(item, *views, origin, samples, sent)
        if samples:
            positions = item.span_start + item.first + picks
            tensor = self._tensors[item.name]
            width = unsigned_numpy_dtype(size)
            self._checks.append(_Check(item.name, tensor, positions, sent.view(width)))
        return direct

    def _consume(self, region: _Region, offset: int, piece: memoryview) -> None:
        """Hash and consume a region's bytes, block by block."""
        owner = region.owner
        if isinstance(owner, _Direct):
            self._write(owner, offset, piece)
            return
        data = owner.data.setdefault(region.buffer, bytearray())
        for block in range(0, len(piece), BLOCK_BYTES):
            self._hasher.update(piece[block : block + BLOCK_BYTES])
            data += piece[block : block + BLOCK_BYTES]
        if len(data) == region.end - region.start:
            owner.missing -= 1
            if owner.missing == 0:
                self._apply_gathered(owner)

    def _write(self, direct: _Direct, offset: int, piece: memoryview) -> None:
        """Hash, undo-copy and write ``piece`` block by block (one undo entry per run of
        undo memory), then keep any sampled entry's bytes."""
        at = direct.origin + offset
        new = np.frombuffer(piece, dtype=np.uint8)
        done = 0
        while done < len(new):
            old = self._undo_memory(len(new) - done)
            self._write_run(direct, at + done, piece[done : done + len(old)], old)
            done += len(old)
        if not direct.samples:
            return
        size = direct.item.itemsize
        first = bisect.bisect_right(direct.samples, offset - size)
        for index in range(first, len(direct.samples)):
            sample = direct.samples[index]
            if sample >= offset + len(new):
                break
            lo, hi = max(sample, offset), min(sample + size, offset + len(new))
            base = index * size
            direct.sent[base + lo - sample : base + hi - sample] = new[lo - offset : hi - offset]

    def _write_run(self, direct: _Direct, at: int, piece: memoryview, old: np.ndarray) -> None:
        """Write ``piece`` at byte ``at`` of the target, its old bits kept in ``old``; the
        undo entry covers every block copied, whatever interrupts the run."""
        target = direct.target
        new = np.frombuffer(piece, dtype=np.uint8)
        kept = 0
        try:
            for lo in range(0, len(new), BLOCK_BYTES):
                hi = min(lo + BLOCK_BYTES, len(new))
                self._hasher.update(piece[lo:hi])
                old[lo:hi] = target[at + lo : at + hi]
                kept = hi
                target[at + lo : at + hi] = new[lo:hi]
        finally:
            if kept:
                self.undo.add(UndoEntry(direct.flat, torch.from_numpy(old[:kept]), start=at))

    def _apply_gathered(self, gathered: _Gathered) -> None:
        layout = self._layout
        assert layout is not None
        stored = [
            StoredBuffer(layout.buffers[b], memoryview(gathered.data.pop(b, bytearray())))
            for b in gathered.buffers
        ]
        decoded = DecodedItem(gathered.item, stored[0] if len(stored) == 2 else None, stored[-1])
        apply_payload(DecodedPayload((decoded,), 0), self._tensors, self._current, undo=self.undo)
        if gathered.picks.size:
            item = gathered.item
            locations = None if decoded.locations is None else unpack_buffer(decoded.locations)
            width = unsigned_numpy_dtype(item.itemsize)
            sent = unpack_buffer(stored[-1]).view(width)[gathered.picks].copy()
            positions = entry_positions(item, locations, gathered.picks)
            self._checks.append(_Check(item.name, self._tensors[item.name], positions, sent))
