"""Wire format of a delta payload: a binary header frame followed by one frame per buffer.

Frame 0 is a fixed 28-byte prelude and the header::

    prelude   magic b"RFDZ" | format u16 | reserved u16 | header_len u32 | xxh3-128 (16 bytes)
    header    n_items u32 | n_buffers u32
              n_buffers x (raw_bytes u64 | n_planes u8 | n_planes x (stored_bytes u64 | codec u8))
              n_items   x (name_len u16 | name utf-8 | dtype u8 | ndim u8 | shape ndim x u64 |
                           span_start u64 | span_stop u64 | encoding u8 | gap_width u8 |
                           first u64 | count u64 | base u64 | target u64)

Every integer is little-endian; ``base`` is ``2**64 - 1`` for a dense item valid against any
base (a resync). Frames 1.. are the buffers, in item order: locations then values for GAPS and
BITMAP items, values alone for RANGE and DENSE, nothing for NONE. The checksum is xxh3-128 over
every byte of every frame except the 16 checksum bytes, and it is verified before anything in
the header is believed. A buffer of ``n_planes`` > 1 holds the byte planes of its
``n_planes``-byte elements one after the other (all first bytes, then all second bytes, ...),
each plane stored raw or as one zstd frame. Decoding only parses integers and UTF-8; it never
executes code. Every item of a payload names the same base and target, and the spans of one
tensor's items are disjoint. ``packages/refit-zmq/CODEC.md`` specifies all of it to the byte.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from refit_core import ChecksumMismatchError, ProtocolError, WeightVersion
from refit_zmq.codec.dtypes import dtype_code, dtype_from_code

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PRELUDE_BYTES",
    "BufferCodec",
    "BufferInfo",
    "BytesLike",
    "DecodedItem",
    "DecodedPayload",
    "DeltaPayload",
    "Encoding",
    "ItemHeader",
    "PayloadHasher",
    "PayloadLayout",
    "PlaneInfo",
    "StoredBuffer",
    "build_payload",
    "carried_checksum",
    "decode_payload",
    "head_length",
    "read_layout",
]

BytesLike = bytes | bytearray | memoryview
"""Anything exposing contiguous bytes through the buffer protocol."""

MAGIC = b"RFDZ"
FORMAT_VERSION = 1
_NO_BASE = (1 << 64) - 1
_MAX_NDIM = 64

_PRELUDE = struct.Struct("<4sHHI16s")
PRELUDE_BYTES = _PRELUDE.size
"""Size of frame 0's fixed prelude (magic, format, header length, checksum)."""
_CHECKSUM_AT = 12
_COUNTS = struct.Struct("<II")
_BUFFER = struct.Struct("<QB")
_PLANE = struct.Struct("<QB")
_PLANE_COUNTS = (1, 2, 4, 8)
_NAME_LEN = struct.Struct("<H")
_DTYPE_NDIM = struct.Struct("<BB")
_ITEM_TAIL = struct.Struct("<QQBBQQQQ")


class Encoding(enum.IntEnum):
    """How an item says which elements of its span it carries."""

    NONE = 0
    """Nothing changed; no buffers."""
    RANGE = 1
    """New bits of span elements ``[first, first + count)``; one values buffer."""
    GAPS = 2
    """Index ``first``, then ``count - 1`` gaps of ``gap_width`` bytes; locations and values."""
    BITMAP = 3
    """One bit per span element (LSB first), ``count`` bits set; locations and values."""
    DENSE = 4
    """New bits of the whole span; one values buffer."""


class BufferCodec(enum.IntEnum):
    """How a buffer's bytes are stored."""

    RAW = 0
    ZSTD = 1


@dataclass(frozen=True)
class PlaneInfo:
    """How one byte plane of a buffer is stored."""

    stored_bytes: int
    codec: BufferCodec


@dataclass(frozen=True)
class BufferInfo:
    """Raw size of one buffer and how each of its byte planes is stored.

    One plane is the buffer's bytes as they are; ``n`` planes are the byte planes of its
    ``n``-byte elements (element byte 0 of every element first).
    """

    raw_bytes: int
    planes: tuple[PlaneInfo, ...]

    @property
    def stored_bytes(self) -> int:
        """Bytes on the wire."""
        return sum(plane.stored_bytes for plane in self.planes)

    def validate(self) -> None:
        """Raise ``ProtocolError`` unless planes and sizes agree."""
        count = len(self.planes)
        if count not in _PLANE_COUNTS or self.raw_bytes % count:
            raise ProtocolError(f"buffer of {self.raw_bytes} bytes in {count} planes")
        for plane in self.planes:
            if plane.codec is BufferCodec.RAW and plane.stored_bytes != self.raw_bytes // count:
                raise ProtocolError("raw plane whose size differs from its share of the buffer")


@dataclass(frozen=True)
class ItemHeader:
    """One tensor span of a payload: what it is, where it sits, how it is coded, which versions."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    span_start: int
    span_stop: int
    encoding: Encoding
    first: int
    count: int
    gap_width: int
    base: WeightVersion | None
    target: WeightVersion

    @property
    def span_len(self) -> int:
        """Elements in the span."""
        return self.span_stop - self.span_start

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    def buffer_sizes(self) -> tuple[int, ...]:
        """Raw byte size of each buffer this item owns, locations first."""
        values = self.count * self.itemsize
        if self.encoding is Encoding.NONE:
            return ()
        if self.encoding is Encoding.GAPS:
            return ((self.count - 1) * self.gap_width, values)
        if self.encoding is Encoding.BITMAP:
            return ((self.span_len + 7) // 8, values)
        return (values,)

    def validate(self) -> None:
        """Raise ``ProtocolError`` unless the fields are consistent with each other."""
        numel = math.prod(self.shape)
        checks = (
            (0 <= self.span_start <= self.span_stop <= numel, "span outside the tensor"),
            (self.base is None or self.base < self.target, "target does not follow base"),
            (self.base is not None or self.encoding is Encoding.DENSE, "only DENSE has no base"),
            (self.encoding is Encoding.GAPS or self.gap_width == 0, "gap width without gaps"),
        )
        by_encoding = {
            Encoding.NONE: self.count == 0 and self.first == 0,
            Encoding.RANGE: self.count >= 1 and self.first + self.count <= self.span_len,
            Encoding.GAPS: self.gap_width in (1, 2, 4, 8)
            and 1 <= self.count <= self.span_len
            and self.first < self.span_len,
            Encoding.BITMAP: self.first == 0 and 1 <= self.count <= self.span_len,
            Encoding.DENSE: self.first == 0 and self.count == self.span_len,
        }
        for ok, what in (*checks, (by_encoding[self.encoding], "count/first invalid")):
            if not ok:
                raise ProtocolError(f"item {self.name!r}: {what}")


@dataclass(frozen=True)
class StoredBuffer:
    """A buffer as it arrived: its info and its stored bytes."""

    info: BufferInfo
    data: memoryview


@dataclass(frozen=True)
class DecodedItem:
    """An item with its stored buffers (``locations`` only for GAPS and BITMAP)."""

    header: ItemHeader
    locations: StoredBuffer | None
    values: StoredBuffer | None


@dataclass(frozen=True)
class DecodedPayload:
    """A verified payload: every item with its buffers, still stored (compressed)."""

    items: tuple[DecodedItem, ...]
    nbytes: int


@dataclass(frozen=True, eq=False)
class DeltaPayload:
    """An encoded payload, ready to send as frames (zero-copy) or as one joined buffer.

    Attributes:
        frames: frame 0 is prelude and header, then one frame per buffer. A dense resync's
            frames may share memory with the producer's baseline; they stay valid until the
            producer's next ``commit``.
        items: the item headers, in wire order.
        changed_elements: elements whose bits differ from the base (sender-side count).
    """

    frames: tuple[BytesLike, ...]
    items: tuple[ItemHeader, ...]
    changed_elements: int

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return sum(memoryview(f).nbytes for f in self.frames)

    @property
    def checksum(self) -> str:
        """The xxh3-128 carried in the prelude, as 32 hex digits (what names the payload)."""
        head = memoryview(self.frames[0]).cast("B")
        return bytes(head[_CHECKSUM_AT : _PRELUDE.size]).hex()

    @property
    def dense_bytes(self) -> int:
        """Bytes of the dense spans this payload represents."""
        return sum(item.span_len * item.itemsize for item in self.items)

    def to_bytes(self) -> bytes:
        """The payload as one contiguous buffer (copies)."""
        return b"".join(memoryview(f).cast("B") for f in self.frames)


def _pack_item(item: ItemHeader) -> bytes:
    name = item.name.encode()
    base = _NO_BASE if item.base is None else item.base.value
    return b"".join(
        (
            _NAME_LEN.pack(len(name)),
            name,
            _DTYPE_NDIM.pack(dtype_code(item.dtype), len(item.shape)),
            struct.pack(f"<{len(item.shape)}Q", *item.shape),
            _ITEM_TAIL.pack(
                item.span_start,
                item.span_stop,
                item.encoding,
                item.gap_width,
                item.first,
                item.count,
                base,
                item.target.value,
            ),
        )
    )


def _pack_buffer_info(info: BufferInfo) -> bytes:
    planes = (_PLANE.pack(plane.stored_bytes, plane.codec) for plane in info.planes)
    return b"".join((_BUFFER.pack(info.raw_bytes, len(info.planes)), *planes))


class PayloadHasher:
    """The payload checksum, computed incrementally over a payload's bytes fed in wire order.

    Lets a receiver hash chunks as they arrive (while they are in cache) and hand the digest
    to :func:`decode_payload` instead of a second pass over the bytes.
    """

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_128()
        self.offset = 0

    def update(self, data: BytesLike) -> None:
        """Hash the next ``len(data)`` bytes of the payload (the checksum field is skipped)."""
        view = memoryview(data).cast("B")
        start = self.offset
        self._hasher.update(view[: max(0, min(len(view), _CHECKSUM_AT - start))])
        self._hasher.update(view[max(0, _PRELUDE.size - start) :])
        self.offset += len(view)

    def digest(self) -> bytes:
        """The xxh3-128 of the bytes fed so far."""
        digest: bytes = self._hasher.digest()
        return digest


def _checksum(frames: Sequence[BytesLike]) -> bytes:
    hasher = PayloadHasher()
    for frame in frames:
        hasher.update(frame)
    return hasher.digest()


def build_payload(
    items: Sequence[ItemHeader],
    buffers: Sequence[tuple[BufferInfo, BytesLike]],
    *,
    changed_elements: int,
) -> DeltaPayload:
    """Assemble header and buffers into a checksummed payload."""
    header = b"".join(
        (
            _COUNTS.pack(len(items), len(buffers)),
            *(_pack_buffer_info(info) for info, _ in buffers),
            *(_pack_item(item) for item in items),
        )
    )
    head = bytearray(_PRELUDE.pack(MAGIC, FORMAT_VERSION, 0, len(header), bytes(16)) + header)
    frames: list[BytesLike] = [head, *(data for _, data in buffers)]
    head[_CHECKSUM_AT : _PRELUDE.size] = _checksum(frames)
    frames[0] = bytes(head)
    return DeltaPayload(tuple(frames), tuple(items), changed_elements)


class _Reader:
    """Bounds-checked little-endian reads from the header."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._at = 0

    def take(self, fmt: struct.Struct) -> tuple[int, ...]:
        if self._at + fmt.size > len(self._data):
            raise ProtocolError("payload header is truncated")
        values = fmt.unpack_from(self._data, self._at)
        self._at += fmt.size
        return tuple(values)

    def raw(self, size: int) -> bytes:
        if self._at + size > len(self._data):
            raise ProtocolError("payload header is truncated")
        out = bytes(self._data[self._at : self._at + size])
        self._at += size
        return out

    def done(self) -> bool:
        return self._at == len(self._data)


def _read_item(reader: _Reader) -> ItemHeader:
    (name_len,) = reader.take(_NAME_LEN)
    try:
        name = reader.raw(name_len).decode()
        code, ndim = reader.take(_DTYPE_NDIM)
        if ndim > _MAX_NDIM:
            raise ProtocolError(f"item {name!r}: {ndim} dimensions")
        shape = reader.take(struct.Struct(f"<{ndim}Q"))
        start, stop, encoding, width, first, count, base, target = reader.take(_ITEM_TAIL)
        item = ItemHeader(
            name=name,
            dtype=dtype_from_code(code),
            shape=shape,
            span_start=start,
            span_stop=stop,
            encoding=Encoding(encoding),
            first=first,
            count=count,
            gap_width=width,
            base=None if base == _NO_BASE else WeightVersion(base),
            target=WeightVersion(target),
        )
    except ProtocolError:
        raise
    except ValueError as exc:  # bad UTF-8, enum value or dtype code
        raise ProtocolError(f"malformed item header: {exc}") from exc
    item.validate()
    return item


def _read_buffer_info(reader: _Reader) -> BufferInfo:
    raw, count = reader.take(_BUFFER)
    if count not in _PLANE_COUNTS:
        raise ProtocolError(f"buffer in {count} planes")
    planes = []
    for _ in range(count):
        stored, codec = reader.take(_PLANE)
        try:
            planes.append(PlaneInfo(stored, BufferCodec(codec)))
        except ValueError as exc:
            raise ProtocolError(f"unknown buffer codec {codec}") from exc
    info = BufferInfo(raw, tuple(planes))
    info.validate()
    return info


def head_length(prefix: BytesLike) -> int:
    """Bytes of frame 0 (prelude and header), from at least the prelude's bytes.

    Raises:
        ProtocolError: not a refit delta payload (its format version is checked by
            :func:`read_layout`, after the checksum).
    """
    head = memoryview(prefix).cast("B")
    if len(head) < _PRELUDE.size:
        raise ProtocolError("payload shorter than its prelude")
    magic, _version, _reserved, header_len, _checksum = _PRELUDE.unpack_from(head)
    if magic != MAGIC:
        raise ProtocolError("not a refit delta payload (bad magic)")
    return _PRELUDE.size + int(header_len)


def carried_checksum(head: BytesLike) -> bytes:
    """The xxh3-128 digest frame 0's prelude carries."""
    return bytes(memoryview(head).cast("B")[_CHECKSUM_AT : _PRELUDE.size])


@dataclass(frozen=True)
class PayloadLayout:
    """What frame 0 says about the rest: every buffer, and every item with its buffers.

    Attributes:
        head_bytes: size of frame 0.
        buffers: every buffer's info, in wire order (frames 1..).
        items: every item header with the indices of its buffers (locations first).
    """

    head_bytes: int
    buffers: tuple[BufferInfo, ...]
    items: tuple[tuple[ItemHeader, tuple[int, ...]], ...]

    @property
    def total_bytes(self) -> int:
        """The whole payload's size."""
        return self.head_bytes + sum(info.stored_bytes for info in self.buffers)


def read_layout(head: BytesLike) -> PayloadLayout:
    """Parse frame 0 (exactly its bytes). Only integers and UTF-8 are read, every count and
    size is checked against the others; the checksum is not (the caller verifies it).

    Raises:
        ProtocolError: not a payload head, or a header that contradicts itself.
    """
    view = memoryview(head).cast("B")
    if head_length(view) != len(view):
        raise ProtocolError("header length does not match frame 0")
    (version,) = struct.unpack_from("<H", view, len(MAGIC))
    if version != FORMAT_VERSION:
        raise ProtocolError(f"unsupported delta payload format {version}")
    reader = _Reader(view[_PRELUDE.size :])
    n_items, n_buffers = reader.take(_COUNTS)
    buffers = tuple(_read_buffer_info(reader) for _ in range(n_buffers))
    items = []
    cursor = 0
    for _ in range(n_items):
        header = _read_item(reader)
        sizes = header.buffer_sizes()
        own = tuple(range(cursor, cursor + len(sizes)))
        cursor += len(sizes)
        if cursor > n_buffers or any(
            buffers[index].raw_bytes != size for index, size in zip(own, sizes, strict=True)
        ):
            raise ProtocolError(f"item {header.name!r}: buffers do not match its header")
        items.append((header, own))
    if cursor != n_buffers or not reader.done():
        raise ProtocolError("payload header has trailing or unclaimed data")
    _check_items_agree([header for header, _ in items])
    return PayloadLayout(len(view), buffers, tuple(items))


def _check_items_agree(items: Sequence[ItemHeader]) -> None:
    """Refuse items with different versions, or two items covering one tensor element."""
    if len({(item.base, item.target) for item in items}) > 1:
        raise ProtocolError("payload items name different base or target versions")
    covered: dict[str, int] = {}
    for name, start, stop in sorted((i.name, i.span_start, i.span_stop) for i in items):
        if start < stop:
            if start < covered.get(name, 0):
                raise ProtocolError(f"payload items overlap in tensor {name!r}")
            covered[name] = stop


def decode_payload(
    payload: DeltaPayload | BytesLike | Sequence[BytesLike], *, digest: bytes | None = None
) -> DecodedPayload:
    """Verify and parse a payload given as a :class:`DeltaPayload`, one buffer, or frames.

    Args:
        payload: the payload.
        digest: the :class:`PayloadHasher` digest of exactly these bytes, computed by the
            caller as they arrived; compared with the carried checksum instead of hashing again.

    Raises:
        ChecksumMismatchError: the bytes are not what the sender hashed.
        ProtocolError: not a payload, or a header that contradicts itself.
    """
    if isinstance(payload, DeltaPayload):
        frames: Sequence[BytesLike] = payload.frames
    elif isinstance(payload, bytes | bytearray | memoryview):
        frames = [payload]
    else:
        frames = payload
    if not frames:
        raise ProtocolError("empty payload")
    first = memoryview(frames[0]).cast("B")
    head_bytes = head_length(first)
    if (_checksum(frames) if digest is None else digest) != carried_checksum(first):
        raise ChecksumMismatchError("delta payload checksum mismatch; nothing was applied")
    layout = read_layout(first[:head_bytes])
    views = [first[:head_bytes]]
    if len(frames) == 1:
        at = head_bytes
        for info in layout.buffers:
            views.append(first[at : at + info.stored_bytes])
            at += info.stored_bytes
        if at != len(first):
            raise ProtocolError(f"payload length {len(first)} does not match its header ({at})")
    else:
        if len(first) != head_bytes:
            raise ProtocolError("header length does not match frame 0")
        views.extend(memoryview(f).cast("B") for f in frames[1:])
    if len(layout.buffers) != len(views) - 1:
        raise ProtocolError(
            f"header names {len(layout.buffers)} buffers, got {len(views) - 1} frames"
        )
    stored = []
    for info, view in zip(layout.buffers, views[1:], strict=True):
        if info.stored_bytes != len(view):
            raise ProtocolError(f"buffer of {len(view)} bytes, header says {info.stored_bytes}")
        stored.append(StoredBuffer(info, view))
    items = []
    for header, own in layout.items:
        locations = stored[own[0]] if len(own) == 2 else None
        values = stored[own[-1]] if own else None
        items.append(DecodedItem(header, locations, values))
    return DecodedPayload(tuple(items), sum(len(v) for v in views))
