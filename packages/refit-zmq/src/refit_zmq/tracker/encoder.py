"""Encode one bucket of items into one payload, on a thread pool.

An item's new bits arrive either in host memory (:class:`HostBits`: compared by the numba
kernel in ranges, one per worker thread but none longer than 4 MiB) or on a device
(:class:`DeviceBits`: compared there with torch ops by one job, so only changed indices and
values reach the host). Every range is compared with the item's baseline slot (or, for a dense resync,
copied) as soon as the item is added, so the work overlaps with the producer of the next
tensor. The worker that finishes an item's last range codes the item at once, on its own
thread: it picks the location encoding and codes the buffers (byte planes and zstd where
they pay) while the other workers compare later items, and no worker waits on another
(queued behind the remaining comparisons instead, every item's coding used to run after
all of them, with the GIL-bound parts of coding on both workers at once);
:meth:`BucketEncoder.finish` assembles the checksummed payload together with the writes
that bring the baseline to the new version on commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from refit_core import WeightVersion
from refit_zmq.codec.buffers import pack_buffer
from refit_zmq.codec.device_diff import fetch_diff
from refit_zmq.codec.diff import diff_range
from refit_zmq.codec.dtypes import int_dtype, unsigned_numpy_dtype
from refit_zmq.codec.format import (
    BufferInfo,
    BytesLike,
    DeltaPayload,
    Encoding,
    ItemHeader,
    build_payload,
)
from refit_zmq.codec.locations import LocationPlan, decode_locations, encode_locations
from refit_zmq.codec.scatter import scatter, write_range
from refit_zmq.tracker.plan import ItemSpan

__all__ = ["BucketEncoder", "DeviceBits", "EncodedBucket", "HostBits", "PendingWrite"]

_WORD = 8
MAX_RANGE_BYTES = 4 << 20
"""Host ranges are at most this long, so the last items of a bucket spread over every
worker (a large item in two halves left one worker idle for half of it: 0.45 -> 0.48 of
memcpy on the codec bench, 65 MiB at 1 % changed; 2 MiB ranges were no faster, 1 MiB slower)."""
_NO_INDICES = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class HostBits:
    """An item's new bits in host memory, as bytes (a view of the tensor where possible)."""

    data: np.ndarray


@dataclass(frozen=True)
class DeviceBits:
    """An item's new bits as a flat integer tensor on its device (a view where possible)."""

    data: torch.Tensor


def _torch_bits(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` (an integer width) sharing ``array``'s bits."""
    return torch.from_numpy(np.require(array, requirements="W").view(np.uint8)).view(dtype)


@dataclass(frozen=True)
class PendingWrite:
    """What a payload carried for one item, kept to bring the baseline slot up on commit.

    ``slot`` is the item's baseline as a flat integer tensor (a host slot viewed as one,
    or a device slot); ``locations`` and ``values`` are host arrays.
    """

    slot: torch.Tensor
    header: ItemHeader
    locations: np.ndarray | None
    values: np.ndarray

    def write(self) -> None:
        """Write the carried bits into the slot."""
        raw = None if self.locations is None else self.locations.view(np.uint8)
        indices = decode_locations(self.header, raw)
        values = _torch_bits(self.values, self.slot.dtype).to(self.slot.device)
        if indices is None:
            write_range(self.slot, self.header.first, values)
        else:
            scatter(self.slot, torch.from_numpy(indices).to(self.slot.device), values)


@dataclass(frozen=True)
class EncodedBucket:
    """A payload and the writes that commit it to the baseline."""

    payload: DeltaPayload
    writes: list[PendingWrite]


Parts = list[tuple[np.ndarray, np.ndarray]] | None
"""What a range job returns: (indices, values) per range, or None for a host copy."""


@dataclass(frozen=True)
class _Coded:
    header: ItemHeader
    buffers: list[tuple[BufferInfo, BytesLike]]
    changed: int
    write: PendingWrite | None
    to_host_bytes: int


Work = Callable[[], Parts]
"""One range's comparison (or copy), run on the pool."""


@dataclass
class _Unit:
    """One item being encoded: its ranges' results and, when coded, its coding's outcome.

    ``remaining`` counts the ranges still running (guarded by the encoder's lock); the worker
    that finishes the last one codes the item at once, on its own thread.
    """

    item: ItemSpan
    slot: np.ndarray | torch.Tensor
    new: HostBits | DeviceBits
    dest: np.ndarray | None
    coded: Future[_Coded] | None
    parts: list[Parts]
    remaining: int
    failure: BaseException | None = None
    jobs: list[Future[None]] = field(default_factory=list)


def _words(array: np.ndarray, width: int) -> np.ndarray:
    return array.view(unsigned_numpy_dtype(width))


def _word_width(slot: np.ndarray, new: np.ndarray, itemsize: int) -> int:
    """8 when both buffers can be read as 64-bit words, else the element size."""
    aligned = slot.ctypes.data % _WORD == 0 and new.ctypes.data % _WORD == 0
    return _WORD if aligned and slot.nbytes % _WORD == 0 else itemsize


def _joined(arrays: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    """The arrays end to end (the one array itself when there is one)."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else empty


def _copy(dest: np.ndarray, new: np.ndarray) -> Parts:
    np.copyto(dest, new)
    return None


def _diff(
    base: np.ndarray, new: np.ndarray, element: np.dtype[np.unsignedinteger], start: int
) -> Parts:
    return [diff_range(base, new, element=element, start=start)]


def _device_diff(slot: torch.Tensor, new: torch.Tensor) -> tuple[Parts, int]:
    """Compare on ``new``'s device (a pinned host slot is copied there first)."""
    base = slot if slot.device == new.device else slot.to(new.device, non_blocking=True)
    found = fetch_diff(base, new)
    values = found.values.view(unsigned_numpy_dtype(new.element_size()))
    return [(found.indices, values)], found.to_host_bytes


def _device_copy(slot: torch.Tensor, new: torch.Tensor, *, keep: bool) -> np.ndarray:
    """The new bits on the host (and, with ``keep``, in the slot too)."""
    host = torch.empty(new.numel(), dtype=new.dtype, pin_memory=new.device.type == "cuda")
    host.copy_(new)
    if keep:
        slot.copy_(new)
    return host.numpy().view(unsigned_numpy_dtype(new.element_size()))


class BucketEncoder:
    """Collects the items of one bucket and encodes them into one payload.

    Args:
        pool: runs comparisons and buffer coding.
        threads: host ranges per item (the pool's worker count).
        chunk_bytes: host ranges are whole multiples of this many bytes.
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
        self.to_host_bytes = 0
        """Bytes device items handed to the host so far: changed indices and values, RANGE
        and dense spans (counted for CPU tensors on the device path too)."""

    def __bool__(self) -> bool:
        return bool(self._units)

    def _ranges(self, size: int, chunk: int, width: int) -> list[tuple[int, int]]:
        """Ranges of whole chunks covering ``[0, size)`` (``width``-byte words): at most
        ``threads`` of them, each at most :data:`MAX_RANGE_BYTES` (or one chunk)."""
        chunks = -(-size // chunk)
        most = max(1, MAX_RANGE_BYTES // width // chunk) * chunk
        per_range = min(most, max(1, -(-chunks // self._threads)) * chunk)
        return [(a, min(size, a + per_range)) for a in range(0, size, per_range)]

    def add(
        self, item: ItemSpan, slot: np.ndarray | torch.Tensor, new: HostBits | DeviceBits
    ) -> None:
        """Start comparing (or copying) ``new``, the item's new bits, against ``slot``.

        A host item's slot is its uint8 host slot; a device item's slot is its flat integer
        slot from :class:`~refit_zmq.tracker.store.DeviceBaselines`.
        """
        if isinstance(new, DeviceBits):
            if not isinstance(slot, torch.Tensor):
                raise TypeError("a device item needs a device baseline slot")
            works, dest = self._add_device(item, slot, new.data)
        else:
            if not isinstance(slot, np.ndarray):
                raise TypeError("a host item needs a host baseline slot")
            works, dest = self._add_host(item, slot, new.data)
        coded: Future[_Coded] | None = Future() if self._code_items else None
        unit = _Unit(item, slot, new, dest, coded, [None] * len(works), len(works))
        self._units.append(unit)
        if coded is not None:
            self._coded.append(coded)
        self.nbytes += item.nbytes
        try:
            if not works:
                unit.jobs.append(self._pool.submit(self._code_into, unit))
            for index, work in enumerate(works):
                unit.jobs.append(self._pool.submit(self._run_range, unit, index, work))
        except BaseException as exc:  # the pool was shut down: fail the item, never hang
            self._ranges_done(unit, max(1, len(works) - len(unit.jobs)), exc)
            raise

    def _run_range(self, unit: _Unit, index: int, work: Work) -> None:
        """Run one range of ``unit``; the worker that finishes its last range codes it."""
        try:
            unit.parts[index] = work()
        except BaseException as exc:
            self._ranges_done(unit, 1, exc)
            raise
        self._ranges_done(unit, 1, None)

    def _ranges_done(self, unit: _Unit, count: int, failure: BaseException | None) -> None:
        with self._lock:
            unit.failure = unit.failure or failure
            unit.remaining -= count
            last = unit.remaining <= 0
        if last:
            self._code_into(unit)

    def _code_into(self, unit: _Unit) -> None:
        """Code ``unit`` (all its ranges done) into its ``coded`` future, or fail it."""
        if unit.coded is None:
            return
        if unit.failure is not None:
            unit.coded.set_exception(unit.failure)
            return
        try:
            unit.coded.set_result(self._code(unit))
        except BaseException as exc:
            unit.coded.set_exception(exc)

    def _add_host(
        self, item: ItemSpan, slot: np.ndarray, new: np.ndarray
    ) -> tuple[list[Work], np.ndarray | None]:
        itemsize = item.dtype.itemsize
        width = _word_width(slot, new, itemsize)
        chunk = max(1, self._chunk_bytes // width)
        new_words = _words(new, width)
        ranges = self._ranges(new_words.size, chunk, width)
        if self._dense:
            dest = (
                slot
                if not self._has_baseline
                else torch.empty(slot.size, dtype=torch.uint8).numpy()
            )
            dest_words = _words(dest, width)
            return [partial(_copy, dest_words[a:b], new_words[a:b]) for a, b in ranges], dest
        base_words = _words(slot, width)
        element = unsigned_numpy_dtype(itemsize)
        return [
            partial(_diff, base_words[a:b], new_words[a:b], element, a) for a, b in ranges
        ], None

    def _add_device(
        self, item: ItemSpan, slot: torch.Tensor, new: torch.Tensor
    ) -> tuple[list[Work], np.ndarray | None]:
        if self._dense:
            dest = _device_copy(slot, new, keep=not self._has_baseline)
            self._count_to_host(item.nbytes)
            return [], dest

        def compare() -> Parts:
            parts, moved = _device_diff(slot, new)
            self._count_to_host(moved)
            return parts

        return [compare], None

    def _count_to_host(self, nbytes: int) -> None:
        with self._lock:
            self.to_host_bytes += nbytes

    def _plan(
        self, unit: _Unit, parts: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[LocationPlan, list[np.ndarray], int]:
        """The item's location plan, its buffers (locations first) and bytes fetched for them."""
        item = unit.item
        elements = unsigned_numpy_dtype(item.dtype.itemsize)
        if unit.dest is not None:
            return LocationPlan(Encoding.DENSE, 0, item.numel), [unit.dest.view(elements)], 0
        indices = _joined([p[0] for p in parts], _NO_INDICES)
        plan, locations = encode_locations(indices, item.numel, item.dtype.itemsize)
        if locations is not None:
            return plan, [locations, _joined([p[1] for p in parts], _NO_INDICES)], 0
        if plan.encoding is Encoding.NONE:
            return plan, [], 0
        span = slice(plan.first, plan.first + plan.count)
        if isinstance(unit.new, DeviceBits):
            carried = unit.new.data[span].cpu().numpy().view(elements)
            return plan, [carried.copy()], carried.nbytes
        return plan, [unit.new.data.view(elements)[span].copy()], 0

    def _code(self, unit: _Unit) -> _Coded:
        item = unit.item
        parts = [part for result in unit.parts for part in result or ()]
        plan, arrays, moved = self._plan(unit, parts)
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
            slot = unit.slot
            if isinstance(slot, np.ndarray):
                slot = _torch_bits(slot, int_dtype(item.dtype))
            write = PendingWrite(slot, header, arrays[0] if len(arrays) == 2 else None, arrays[-1])
        return _Coded(header, buffers, changed, write, moved)

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
        self._count_to_host(sum(c.to_host_bytes for c in coded))
        return EncodedBucket(payload, [c.write for c in coded if c.write is not None])
