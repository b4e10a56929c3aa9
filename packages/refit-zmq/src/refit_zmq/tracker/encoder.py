"""Encode one bucket of items into one payload, on a thread pool.

Each item's bits are cut into at most one range per worker thread; every range is compared
with the item's baseline slot (or, for a dense resync, copied) as soon as the item is added,
so the work overlaps with the producer of the next tensor. When an item's last range is
done, a coding job picks its location encoding and codes its buffers (shuffle and zstd where
they pay), overlapping the comparison of later items without a worker waiting on another;
:meth:`BucketEncoder.finish` assembles the checksummed payload together with the writes that
bring the baseline to the new version on commit.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from refit_core import WeightVersion
from refit_zmq.codec.buffers import pack_buffer
from refit_zmq.codec.diff import diff_range
from refit_zmq.codec.dtypes import unsigned_numpy_dtype
from refit_zmq.codec.format import (
    BufferInfo,
    BytesLike,
    DeltaPayload,
    Encoding,
    ItemHeader,
    build_payload,
)
from refit_zmq.codec.locations import (
    LocationPlan,
    decode_locations,
    encode_locations,
)
from refit_zmq.tracker.plan import ItemSpan

__all__ = ["BucketEncoder", "EncodedBucket", "PendingWrite"]

_WORD = 8
_NO_INDICES = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class PendingWrite:
    """What a payload carried for one item, kept to bring the baseline slot up on commit."""

    slot: np.ndarray
    header: ItemHeader
    locations: np.ndarray | None
    values: np.ndarray

    def write(self) -> None:
        """Write the carried bits into the slot (element view of the item's span)."""
        raw = None if self.locations is None else self.locations.view(np.uint8)
        indices = decode_locations(self.header, raw)
        if indices is None:
            self.slot[self.header.first : self.header.first + self.header.count] = self.values
        else:
            self.slot[indices] = self.values


@dataclass(frozen=True)
class EncodedBucket:
    """A payload and the writes that commit it to the baseline."""

    payload: DeltaPayload
    writes: list[PendingWrite]


Parts = list[tuple[np.ndarray, np.ndarray]] | None
"""What a range job returns: per-chunk (indices, values), or None for a copy."""


@dataclass(frozen=True)
class _Unit:
    """One item being encoded and the range jobs running on it."""

    item: ItemSpan
    slot: np.ndarray
    new: np.ndarray
    dest: np.ndarray | None
    jobs: list[Future[Parts]]


@dataclass(frozen=True)
class _Coded:
    header: ItemHeader
    buffers: list[tuple[BufferInfo, BytesLike]]
    changed: int
    write: PendingWrite | None


def _words(array: np.ndarray, width: int) -> np.ndarray:
    return array.view(unsigned_numpy_dtype(width))


def _word_width(slot: np.ndarray, new: np.ndarray, itemsize: int) -> int:
    """8 when both buffers can be read as 64-bit words, else the element size."""
    aligned = slot.ctypes.data % _WORD == 0 and new.ctypes.data % _WORD == 0
    return _WORD if aligned and slot.nbytes % _WORD == 0 else itemsize


def _relay(target: Future[_Coded], source: Future[_Coded]) -> None:
    """Give ``target`` the outcome of ``source``."""
    exc = source.exception()
    if exc is None:
        target.set_result(source.result())
    else:
        target.set_exception(exc)


def _copy(dest: np.ndarray, new: np.ndarray) -> Parts:
    np.copyto(dest, new)
    return None


class BucketEncoder:
    """Collects the items of one bucket and encodes them into one payload.

    Args:
        pool: runs comparisons and buffer coding.
        threads: ranges per item (the pool's worker count).
        chunk_bytes: bytes of one side of one compare step (cache-sized).
        base: the committed version the payload is a delta against (ignored when ``dense``).
        target: the version the payload brings receivers to.
        dense: send every item DENSE with no base (a resync, valid against any receiver).
        has_baseline: whether the slots hold the base bits. Without one (``dense`` must be
            set) the new bits are copied straight into the slots, which is also how a
            baseline is loaded.
        compress: allow zstd on buffers.
        code: code each item into payload buffers (False when only loading a baseline).
    """

    def __init__(
        self,
        pool: Executor,
        *,
        threads: int,
        chunk_bytes: int,
        base: WeightVersion | None,
        target: WeightVersion,
        dense: bool,
        has_baseline: bool,
        compress: bool,
        code: bool = True,
    ) -> None:
        if not (dense or has_baseline):
            raise ValueError("without a baseline only a dense resync can be encoded")
        self._pool = pool
        self._threads = threads
        self._chunk_bytes = chunk_bytes
        self._base = None if dense else base
        self._target = target
        self._dense = dense
        self._has_baseline = has_baseline
        self._compress = compress
        self._code_items = code
        self._units: list[_Unit] = []
        self._coded: list[Future[_Coded]] = []
        self._lock = threading.Lock()
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self._units)

    def _ranges(self, size: int, chunk: int) -> list[tuple[int, int]]:
        """At most ``threads`` ranges of whole chunks covering ``[0, size)``."""
        chunks = -(-size // chunk)
        per_range = max(1, -(-chunks // self._threads)) * chunk
        return [(a, min(size, a + per_range)) for a in range(0, size, per_range)]

    def add(self, item: ItemSpan, slot: np.ndarray, new: np.ndarray) -> None:
        """Start comparing (or copying) ``new``, the item's new bytes, against ``slot``."""
        itemsize = item.dtype.itemsize
        width = _word_width(slot, new, itemsize)
        chunk = max(1, self._chunk_bytes // width)
        new_words = _words(new, width)
        jobs: list[Future[Parts]]
        dest = None
        if self._dense:
            dest = (
                slot
                if not self._has_baseline
                else torch.empty(slot.size, dtype=torch.uint8).numpy()
            )
            dest_words = _words(dest, width)
            jobs = [
                self._pool.submit(_copy, dest_words[a:b], new_words[a:b])
                for a, b in self._ranges(new_words.size, chunk)
            ]
        else:
            base_words = _words(slot, width)
            element = unsigned_numpy_dtype(itemsize)
            jobs = [
                self._pool.submit(
                    diff_range,
                    base_words[a:b],
                    new_words[a:b],
                    element=element,
                    start=a,
                    chunk_words=chunk,
                )
                for a, b in self._ranges(new_words.size, chunk)
            ]
        unit = _Unit(item, slot, new, dest, jobs)
        self._units.append(unit)
        if self._code_items:
            self._coded.append(self._code_when_compared(unit))
        self.nbytes += item.nbytes

    def _plan(
        self, unit: _Unit, parts: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[LocationPlan, list[np.ndarray]]:
        """The item's location plan and its buffers (locations first)."""
        item = unit.item
        elements = unsigned_numpy_dtype(item.dtype.itemsize)
        if unit.dest is not None:
            return LocationPlan(Encoding.DENSE, 0, item.numel), [unit.dest.view(elements)]
        indices = np.concatenate([p[0] for p in parts]) if parts else _NO_INDICES
        plan, locations = encode_locations(indices, item.numel, item.dtype.itemsize)
        if locations is not None:
            return plan, [locations, np.concatenate([p[1] for p in parts])]
        if plan.encoding is Encoding.NONE:
            return plan, []
        carried = unit.new.view(elements)[plan.first : plan.first + plan.count]
        return plan, [carried.copy()]

    def _code_when_compared(self, unit: _Unit) -> Future[_Coded]:
        """The unit's coding, submitted by whichever of its range jobs completes last."""
        coded: Future[_Coded] = Future()
        remaining = max(1, len(unit.jobs))

        def range_done(_: object = None) -> None:
            nonlocal remaining
            with self._lock:
                remaining -= 1
                if remaining > 0:
                    return
            try:
                self._pool.submit(self._code, unit).add_done_callback(partial(_relay, coded))
            except BaseException as exc:  # the pool was shut down: fail, never hang
                coded.set_exception(exc)

        if not unit.jobs:
            range_done()
        for job in unit.jobs:
            job.add_done_callback(range_done)
        return coded

    def _code(self, unit: _Unit) -> _Coded:
        item = unit.item
        parts = [chunk for job in unit.jobs for chunk in job.result() or ()]
        plan, arrays = self._plan(unit, parts)
        header = ItemHeader(
            name=item.name,
            dtype=item.dtype,
            shape=item.spec.shape,
            span_start=item.start,
            span_stop=item.stop,
            encoding=plan.encoding,
            first=plan.first,
            count=plan.count,
            gap_width=plan.gap_width,
            base=self._base,
            target=self._target,
        )
        buffers = [pack_buffer(array, compress=self._compress) for array in arrays]
        changed = item.numel if self._dense else sum(p[0].size for p in parts)
        write = None
        if arrays and self._has_baseline:
            slot = unit.slot.view(unsigned_numpy_dtype(item.dtype.itemsize))
            write = PendingWrite(slot, header, arrays[0] if len(arrays) == 2 else None, arrays[-1])
        return _Coded(header, buffers, changed, write)

    def settle(self) -> None:
        """Wait for every job (before abandoning the bucket)."""
        for unit in self._units:
            for job in unit.jobs:
                job.exception()
        for coded in self._coded:
            coded.exception()

    def finish(self) -> EncodedBucket:
        """Wait for every item's coding and build the payload."""
        coded = [job.result() for job in self._coded]
        payload = build_payload(
            [c.header for c in coded],
            [buffer for c in coded for buffer in c.buffers],
            changed_elements=sum(c.changed for c in coded),
        )
        return EncodedBucket(payload, [c.write for c in coded if c.write is not None])
