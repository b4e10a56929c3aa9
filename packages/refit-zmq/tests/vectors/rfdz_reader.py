"""An RFDZ reader written from CODEC.md alone: struct, xxhash and zstandard, no refit code.

It exists to prove the specification complete: ``test_vectors.py`` checks that it reads every
test vector exactly as refit's codec does and refuses the same malformed payloads.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, fields

import xxhash
import zstandard

NULL_BASE = (1 << 64) - 1
DTYPES: tuple[tuple[str, int], ...] = (
    ("bool", 1),
    ("uint8", 1),
    ("int8", 1),
    ("int16", 2),
    ("int32", 4),
    ("int64", 8),
    ("float16", 2),
    ("bfloat16", 2),
    ("float32", 4),
    ("float64", 8),
    ("float8_e4m3fn", 1),
    ("float8_e5m2", 1),
    ("float8_e4m3fnuz", 1),
    ("float8_e5m2fnuz", 1),
    ("float8_e8m0fnu", 1),
    ("uint16", 2),
    ("uint32", 4),
    ("uint64", 8),
)
"""(name, itemsize) by dtype code."""
ENCODINGS = ("NONE", "RANGE", "GAPS", "BITMAP", "DENSE")
CODECS = ("raw", "zstd")


class MalformedError(ValueError):
    """The payload breaks a rule of CODEC.md."""


class ChecksumMismatchError(ValueError):
    """The payload's bytes are not what its checksum says."""


@dataclass(frozen=True)
class Plane:
    stored_bytes: int
    codec: str


@dataclass(frozen=True)
class Buffer:
    raw_bytes: int
    planes: tuple[Plane, ...]


@dataclass(frozen=True)
class Payload:
    """A verified, decoded payload."""

    checksum: str
    frames: tuple[int, ...]
    buffers: tuple[Buffer, ...]
    items: tuple[Item, ...]


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def read(self, fmt: str) -> int:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.data):
            raise MalformedError("header too short for its records")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return int(value)

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.data):
            raise MalformedError("header too short for its records")
        out = self.data[self.at : self.at + size]
        self.at += size
        return out


def _buffer(cursor: _Cursor) -> Buffer:
    raw_bytes = cursor.read("Q")
    n_planes = cursor.read("B")
    if n_planes not in (1, 2, 4, 8) or raw_bytes % n_planes:
        raise MalformedError("bad plane count")
    planes = []
    for _ in range(n_planes):
        stored, codec = cursor.read("Q"), cursor.read("B")
        if codec > 1:
            raise MalformedError("unknown codec")
        if codec == 0 and stored != raw_bytes // n_planes:
            raise MalformedError("raw plane of the wrong size")
        planes.append(Plane(stored, CODECS[codec]))
    return Buffer(raw_bytes, tuple(planes))


@dataclass(frozen=True)
class Header:
    """One item record of the header, as CODEC.md section 4 lays it out."""

    name: str
    dtype_code: int
    shape: tuple[int, ...]
    span_start: int
    span_stop: int
    encoding: str
    gap_width: int
    first: int
    count: int
    base: int | None
    target: int

    @property
    def span_len(self) -> int:
        return self.span_stop - self.span_start

    def buffer_sizes(self) -> tuple[int, ...]:
        values = self.count * DTYPES[self.dtype_code][1]
        return {
            "NONE": (),
            "RANGE": (values,),
            "GAPS": ((self.count - 1) * self.gap_width, values),
            "BITMAP": ((self.span_len + 7) // 8, values),
            "DENSE": (values,),
        }[self.encoding]


@dataclass(frozen=True)
class Item(Header):
    """A header with the buffers it owns and the elements it writes."""

    buffers: tuple[int, ...]
    writes: tuple[tuple[int, bytes], ...]
    """(tensor row-major flat index, new element bytes) of every element written, in order."""

    @property
    def dtype(self) -> str:
        return DTYPES[self.dtype_code][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype_code][1]


def _item(cursor: _Cursor) -> Header:
    name_len = cursor.read("H")
    try:
        name = cursor.take(name_len).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedError("name is not UTF-8") from exc
    dtype_code, ndim = cursor.read("B"), cursor.read("B")
    if dtype_code >= len(DTYPES) or ndim > 64:
        raise MalformedError("unknown dtype or too many dimensions")
    shape = tuple(cursor.read("Q") for _ in range(ndim))
    start, stop = cursor.read("Q"), cursor.read("Q")
    encoding_code, gap_width = cursor.read("B"), cursor.read("B")
    first, count, base, target = (cursor.read("Q") for _ in range(4))
    if encoding_code >= len(ENCODINGS):
        raise MalformedError("unknown encoding")
    numel = 1
    for dim in shape:
        numel *= dim
    h = Header(
        name,
        dtype_code,
        shape,
        start,
        stop,
        ENCODINGS[encoding_code],
        gap_width,
        first,
        count,
        None if base == NULL_BASE else base,
        target,
    )
    span = h.span_len
    rules = {
        "NONE": first == 0 and count == 0,
        "RANGE": count >= 1 and first + count <= span,
        "GAPS": gap_width in (1, 2, 4, 8) and 1 <= count <= span and first < span,
        "BITMAP": first == 0 and 1 <= count <= span,
        "DENSE": first == 0 and count == span,
    }
    if not (start <= stop <= numel):
        raise MalformedError("span outside the tensor")
    if h.encoding != "GAPS" and gap_width != 0:
        raise MalformedError("gap width without GAPS")
    if not rules[h.encoding]:
        raise MalformedError("first/count break the encoding's rules")
    if h.base is None and h.encoding != "DENSE":
        raise MalformedError("null base on a non-DENSE item")
    if h.base is not None and not h.base < target:
        raise MalformedError("base not below target")
    return h


def _plane(data: bytes, plane: Plane, size: int) -> bytes:
    if plane.codec == "raw":
        return data
    try:
        params = zstandard.get_frame_parameters(data)
        if params.content_size != size or params.dict_id != 0:
            raise MalformedError("zstd frame without the right content size, or with a dictionary")
        out = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise MalformedError(f"bad zstd plane: {exc}") from exc
    if len(out) != size:
        raise MalformedError("zstd plane of the wrong size")
    return out


def _decode_buffer(buffer: Buffer, stored: bytes) -> bytes:
    p = len(buffer.planes)
    size = buffer.raw_bytes // p
    planes = []
    at = 0
    for plane in buffer.planes:
        planes.append(_plane(stored[at : at + plane.stored_bytes], plane, size))
        at += plane.stored_bytes
    if p == 1:
        return planes[0]
    out = bytearray(buffer.raw_bytes)
    for k, plane_bytes in enumerate(planes):
        out[k::p] = plane_bytes
    return bytes(out)


def _indices(h: Header, locations: bytes) -> list[int]:
    if h.encoding == "GAPS":
        fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[h.gap_width]
        gaps = struct.unpack(f"<{h.count - 1}{fmt}", locations)
        indices = [h.first]
        for gap in gaps:
            if gap < 1:
                raise MalformedError("gap of 0")
            indices.append(indices[-1] + gap)
        if indices[-1] >= h.span_len:
            raise MalformedError("index past the span")
        return indices
    if h.encoding == "BITMAP":
        found = [j for j in range(h.span_len) if locations[j // 8] >> (j % 8) & 1]
        if len(found) != h.count:
            raise MalformedError("bitmap bit count differs from count")
        return found
    return list(range(h.first, h.first + h.count))


def read(data: bytes) -> Payload:
    """Parse, verify and decode a joined payload, or raise ``MalformedError``/``ChecksumMismatchError``."""
    if len(data) < 28 or data[:4] != b"RFDZ":
        raise MalformedError("not an RFDZ payload")
    if xxhash.xxh3_128(data[:12] + data[28:]).digest() != data[12:28]:
        raise ChecksumMismatchError("checksum mismatch")
    fmt_version, _reserved, header_len = struct.unpack_from("<HHI", data, 4)
    if fmt_version != 1:
        raise MalformedError("unknown format")
    if 28 + header_len > len(data):
        raise MalformedError("shorter than its header")
    cursor = _Cursor(data[28 : 28 + header_len])
    n_items, n_buffers = cursor.read("I"), cursor.read("I")
    buffers = tuple(_buffer(cursor) for _ in range(n_buffers))
    headers = [_item(cursor) for _ in range(n_items)]
    if cursor.at != header_len:
        raise MalformedError("bytes left over in the header")
    if len({(h.base, h.target) for h in headers}) > 1:
        raise MalformedError("items disagree on base or target")
    owned: list[tuple[int, ...]] = []
    next_buffer = 0
    for h in headers:
        sizes = h.buffer_sizes()
        own = tuple(range(next_buffer, next_buffer + len(sizes)))
        next_buffer += len(sizes)
        if next_buffer > n_buffers or any(
            buffers[b].raw_bytes != size for b, size in zip(own, sizes, strict=True)
        ):
            raise MalformedError("buffers do not match the items")
        owned.append(own)
    if next_buffer != n_buffers:
        raise MalformedError("unowned buffers")
    spans: dict[str, list[tuple[int, int]]] = {}
    for h in headers:
        if h.span_len:
            spans.setdefault(h.name, []).append((h.span_start, h.span_stop))
    for ranges in spans.values():
        ranges.sort()
        if any(b[0] < a[1] for a, b in itertools.pairwise(ranges)):
            raise MalformedError("overlapping spans")
    frames = [28 + header_len]
    stored: list[bytes] = []
    at = 28 + header_len
    for buffer in buffers:
        size = sum(p.stored_bytes for p in buffer.planes)
        stored.append(data[at : at + size])
        frames.append(size)
        at += size
    if at != len(data):
        raise MalformedError("length differs from the header's")
    items = []
    for h, own in zip(headers, owned, strict=True):
        decoded = [_decode_buffer(buffers[b], stored[b]) for b in own]
        writes: tuple[tuple[int, bytes], ...] = ()
        if decoded:
            values = decoded[-1]
            size = DTYPES[h.dtype_code][1]
            indices = _indices(h, decoded[0] if len(decoded) == 2 else b"")
            writes = tuple(
                (h.span_start + j, values[n * size : (n + 1) * size]) for n, j in enumerate(indices)
            )
        header = {f.name: getattr(h, f.name) for f in fields(h)}
        items.append(Item(**header, buffers=own, writes=writes))
    return Payload(data[12:28].hex(), tuple(frames), buffers, tuple(items))


def apply(payload: Payload, tensors: dict[str, bytearray]) -> None:
    """Write every item's elements into ``tensors`` (name -> all bits, row-major)."""
    for item in payload.items:
        bits = tensors[item.name]
        for index, value in item.writes:
            bits[index * item.itemsize : (index + 1) * item.itemsize] = value
