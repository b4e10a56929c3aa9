"""Write the RFDZ test vectors of CODEC.md: payload bytes and what they decode to.

Run from the repository root (it rewrites ``packages/refit-zmq/tests/vectors/data/``)::

    uv run python packages/refit-zmq/tests/vectors/generate.py

Every valid vector is a payload written by refit's own producer code: most by the tracker
(``DeltaCompressionTracker``, from the ``before`` and ``after`` tensors it records), a few by
``build_payload`` where no small tensor reaches a case (8-byte gaps). Each ``NAME.json``
holds the frame sizes, the checksum, the buffer table, every item's header fields and the
elements it writes, and the tensors before and after (or, for a decode-only vector, none).
Invalid vectors are valid ones with one defect (and, except for the checksum case, a
recomputed checksum), with the error a reader must raise. ``test_vectors.py`` checks that an
independent reader agrees with every file and that refit re-encodes every payload to the
same bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from refit_core import TensorSpec, WeightVersion
from refit_zmq.codec import DecodedItem, decode_payload, unpack_buffer
from refit_zmq.codec.buffers import pack_buffer
from refit_zmq.codec.dtypes import WIRE_DTYPES, dtype_code
from refit_zmq.codec.format import (
    BufferCodec,
    BufferInfo,
    BytesLike,
    DeltaPayload,
    Encoding,
    ItemHeader,
    build_payload,
)
from refit_zmq.codec.locations import decode_locations
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

DATA = Path(__file__).resolve().parent / "data"
SMALL_TENSOR_BYTES = 16384
"""Tensors up to this size are written out whole ("before" hex); larger ones as a fill."""

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TrackerCase:
    """A payload the tracker encodes from ``before`` (committed at ``base``) to ``after``."""

    description: str
    before: State
    after: State
    base: int | None
    target: int
    max_item_bytes: int = 64 << 20
    fill: Mapping[str, str] = field(default_factory=dict)
    """Tensors whose ``before`` is one repeated element (hex), written as such."""


def _bits_hex(tensor: torch.Tensor) -> str:
    return _raw(tensor).hex()


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _tracker_payload(case: TrackerCase) -> DeltaPayload:
    spec = {name: TensorSpec.of(t) for name, t in case.after.items()}
    config = TrackerConfig(threads=1, max_item_bytes=case.max_item_bytes)
    with DeltaCompressionTracker(spec, config) as tracker:
        if case.base is not None:
            tracker.load_baseline(case.before, WeightVersion(case.base))
        (payload,) = tracker.encode(case.after, WeightVersion(case.target))
        return DeltaPayload(
            tuple(bytes(memoryview(f).cast("B")) for f in payload.frames), payload.items, 0
        )


def _writes(decoded: DecodedItem) -> list[list[object]]:
    """``[flat index, element hex]`` of every element the item writes, in order."""
    item = decoded.header
    if decoded.values is None:
        return []
    values = unpack_buffer(decoded.values).reshape(-1, item.itemsize)
    raw = None if decoded.locations is None else unpack_buffer(decoded.locations)
    indices = decode_locations(item, raw)
    if indices is None:
        indices = np.arange(item.first, item.first + item.count)
    return [
        [int(item.span_start + i), bytes(v).hex()] for i, v in zip(indices, values, strict=True)
    ]


def _item_json(decoded: DecodedItem, buffers: list[int]) -> dict[str, object]:
    h = decoded.header
    return {
        "name": h.name,
        "dtype": str(h.dtype).removeprefix("torch."),
        "dtype_code": dtype_code(h.dtype),
        "shape": list(h.shape),
        "span_start": h.span_start,
        "span_stop": h.span_stop,
        "encoding": h.encoding.name,
        "encoding_code": int(h.encoding),
        "gap_width": h.gap_width,
        "first": h.first,
        "count": h.count,
        "base": None if h.base is None else h.base.value,
        "target": h.target.value,
        "buffers": buffers,
        "writes": _writes(decoded),
    }


def _buffer_json(info: BufferInfo) -> dict[str, object]:
    return {
        "raw_bytes": info.raw_bytes,
        "planes": [
            {"stored_bytes": p.stored_bytes, "codec": p.codec.name.lower()} for p in info.planes
        ],
    }


def _payload_json(frames: tuple[BytesLike, ...]) -> dict[str, Any]:
    decoded = decode_payload(list(frames))
    infos: list[BufferInfo] = []
    items = []
    cursor = 0
    for item in decoded.items:
        own = [s.info for s in (item.locations, item.values) if s is not None]
        items.append(_item_json(item, list(range(cursor, cursor + len(own)))))
        infos += own
        cursor += len(own)
    head = memoryview(frames[0]).cast("B")
    return {
        "frames": [memoryview(f).nbytes for f in frames],
        "checksum": bytes(head[12:28]).hex(),
        "buffers": [_buffer_json(info) for info in infos],
        "items": items,
    }


def _tensors_json(case: TrackerCase) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, after in case.after.items():
        before = case.before[name]
        entry: dict[str, object] = {
            "dtype": str(after.dtype).removeprefix("torch."),
            "shape": list(after.shape),
        }
        if name in case.fill:
            entry["before"] = {"fill": case.fill[name]}
        else:
            if before.numel() * before.element_size() > SMALL_TENSOR_BYTES:
                raise ValueError(f"tensor {name} too large to write out; give a fill")
            entry["before"] = _bits_hex(before)
            entry["after"] = _bits_hex(after)
        entry["after_xxh3_64"] = xxhash.xxh3_64(_raw(after)).hexdigest()
        out[name] = entry
    return out


def _dumps(meta: Mapping[str, object]) -> str:
    """JSON with one line per top-level field, per item and per tensor."""
    lines = []
    for key, value in meta.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            inner = ",\n  ".join(json.dumps(v) for v in value)
            lines.append(f"{json.dumps(key)}: [\n  {inner}\n ]")
        elif isinstance(value, dict) and key == "tensors":
            inner = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{json.dumps(key)}: {{\n  {inner}\n }}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def _write(name: str, frames: tuple[BytesLike, ...], meta: dict[str, object]) -> None:
    (DATA / f"{name}.rfdz").write_bytes(b"".join(memoryview(f).cast("B") for f in frames))
    (DATA / f"{name}.json").write_text(_dumps(meta), encoding="utf-8")


def _bf16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def _example() -> TrackerCase:
    before = {
        "norm": torch.tensor([1.0, 1.0, 1.0, 1.0]),
        "w": _bf16([0.5, -0.25, 0.125, 1.0, 2.0, -1.0, 0.0, 0.75] * 2).view(2, 8),
        "b": torch.tensor([1, -2, 3], dtype=torch.int8),
    }
    after = {name: t.clone() for name, t in before.items()}
    after["norm"][1:3] = torch.tensor([1.5, 0.5])
    flat = after["w"].view(-1)
    flat[3], flat[4], flat[12] = 1.0078125, 2.015625, -0.5
    return TrackerCase(
        "The worked example of CODEC.md: a delta from version 7 to 8 with a RANGE item (two "
        "float32 norms), a GAPS item (three bf16 elements, 1-byte gaps) and a NONE item.",
        before,
        after,
        base=7,
        target=8,
    )


def _resync() -> TrackerCase:
    after = {
        "h": torch.tensor([0.5, -0.0, float("inf")], dtype=torch.float16),
        "i": torch.tensor([-1, 1 << 40], dtype=torch.int64),
        "m": torch.tensor([True, False, True, True, False]),
        "e": torch.empty(0, 3, dtype=torch.uint8),
        "d": torch.tensor([[math.pi, -math.e]], dtype=torch.float64),
        "f8": torch.tensor([0.5, -2.0, 448.0, 0.0], dtype=torch.float8_e4m3fn),
    }
    before = {name: torch.zeros_like(t) for name, t in after.items()}
    return TrackerCase(
        "A dense resync to version 1 (base null): every item DENSE, valid against any "
        "receiver, one of every other dtype family, an empty tensor included.",
        before,
        after,
        base=None,
        target=1,
    )


def _adamw_like(numel: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    before = (0.02 * torch.randn(numel, generator=gen)).to(torch.bfloat16)
    after = before.clone()
    hit = torch.rand(numel, generator=gen) < fraction
    after[hit] = (before[hit].float() * (1 + 0.01 * torch.randn(int(hit.sum()), generator=gen))).to(
        torch.bfloat16
    )
    return before, after


def _bitmap_zstd() -> TrackerCase:
    before, after = _adamw_like(2048, 0.4, seed=1)
    return TrackerCase(
        "One bf16 tensor with about 40% of its elements changed: a BITMAP item whose values "
        "are stored in two byte planes, the sign/exponent plane as a zstd frame.",
        {"layer.weight": before},
        {"layer.weight": after},
        base=3,
        target=4,
    )


def _range_planes() -> TrackerCase:
    gen = torch.Generator().manual_seed(2)
    before = torch.zeros(1024)
    after = before.clone()
    after[100:900] = 0.02 * torch.randn(800, generator=gen)
    return TrackerCase(
        "A float32 slice rewritten: a RANGE item of 800 elements in four byte planes, the "
        "exponent planes zstd, the mantissa planes raw.",
        {"slice": before},
        {"slice": after},
        base=10,
        target=11,
        fill={"slice": "00000000"},
    )


def _split_items() -> TrackerCase:
    gen = torch.Generator().manual_seed(3)
    before = torch.randn(4, 64, generator=gen)
    after = before.clone()
    after[0, 5] = 7.0
    after[0, 40] = -7.0
    after[1, :] = after[1, :] + 1.0
    after[3, 60:] = -1.0
    return TrackerCase(
        "One float32 tensor of 256 elements cut into four items of 64 (max_item_bytes 256): "
        "spans starting past 0, with GAPS, DENSE, NONE and RANGE items.",
        {"t": before},
        {"t": after},
        base=0,
        target=1,
        max_item_bytes=256,
    )


def _wide_gaps() -> TrackerCase:
    before = torch.zeros(70000, dtype=torch.uint8)
    after = before.clone()
    after[5], after[69990], after[69995] = 1, 2, 3
    return TrackerCase(
        "A uint8 tensor of 70000 zero elements with three changed: GAPS with 4-byte gaps "
        "(the largest gap, 69985, needs more than 16 bits).",
        {"big": before},
        {"big": after},
        base=41,
        target=42,
        fill={"big": "00"},
    )


TRACKER_CASES: dict[str, Callable[[], TrackerCase]] = {
    "example": _example,
    "resync_dense": _resync,
    "bitmap_zstd": _bitmap_zstd,
    "range_planes": _range_planes,
    "split_items": _split_items,
    "gaps_wide": _wide_gaps,
}


def _gaps_width8() -> tuple[tuple[BytesLike, ...], str]:
    """Two elements 2**32 + 5 apart in a tensor no test can hold: decode-only."""
    numel = (1 << 32) + 16
    gaps = np.array([(1 << 32) + 5], dtype=np.uint64)
    values = np.array([0x3F80, 0xBF80], dtype=np.uint16)
    header = ItemHeader(
        name="huge.weight",
        dtype=torch.bfloat16,
        shape=(numel,),
        span_start=0,
        span_stop=numel,
        encoding=Encoding.GAPS,
        first=3,
        count=2,
        gap_width=8,
        base=WeightVersion(5),
        target=WeightVersion(6),
    )
    buffers = [pack_buffer(gaps, compress=True), pack_buffer(values, compress=True)]
    payload = build_payload([header], buffers, changed_elements=2)
    return payload.frames, (
        "GAPS with 8-byte gaps, built directly (a gap of 2**32 + 5 needs a tensor of more than "
        "2**32 elements, so the vector has no tensors: decode only)."
    )


def _built(items: list[ItemHeader], values: list[np.ndarray]) -> bytes:
    buffers = [pack_buffer(v, compress=False) for v in values]
    return build_payload(items, buffers, changed_elements=0).to_bytes()


def _dense_item(name: str, start: int, stop: int, base: int, target: int) -> ItemHeader:
    return ItemHeader(
        name=name,
        dtype=torch.int16,
        shape=(8,),
        span_start=start,
        span_stop=stop,
        encoding=Encoding.DENSE,
        first=0,
        count=stop - start,
        gap_width=0,
        base=WeightVersion(base),
        target=WeightVersion(target),
    )


def _disagreeing() -> dict[str, tuple[bytes, str, str]]:
    """Payloads whose items are each valid but contradict each other."""
    four = np.arange(4, dtype=np.int16)
    return {
        "bad_mixed_versions": (
            _built([_dense_item("a", 0, 4, 1, 2), _dense_item("b", 0, 4, 1, 3)], [four, four]),
            "malformed",
            "two items with targets 2 and 3 (every item of a payload names the same base "
            "and target)",
        ),
        "bad_overlap": (
            _built([_dense_item("a", 0, 4, 1, 2), _dense_item("a", 3, 7, 1, 2)], [four, four]),
            "malformed",
            "two items of tensor a covering element 3 both (spans of one tensor are disjoint)",
        ),
    }


def _rechecksum(data: bytearray) -> bytes:
    data[12:28] = xxhash.xxh3_128(bytes(data[:12] + data[28:])).digest()
    return bytes(data)


def _invalid(example: bytes, zstd_case: tuple[BytesLike, ...]) -> dict[str, tuple[bytes, str, str]]:
    """Name -> (payload bytes, error kind, what is wrong)."""
    flipped = bytearray(example)
    flipped[-1] ^= 0x01
    version = bytearray(example)
    version[4:6] = struct.pack("<H", 2)
    # frame 0 of the example ends with the NONE item; its buffers follow: RANGE values (8
    # bytes), GAPS locations (2 bytes), GAPS values (6 bytes).
    zero_gap = bytearray(example)
    zero_gap[-8] = 0
    trailing = b"".join(memoryview(f).cast("B") for f in zstd_case)
    zstd_head = bytearray(memoryview(zstd_case[0]).cast("B"))
    return {
        "bad_checksum": (
            bytes(flipped),
            "checksum",
            "the example with one bit of its last value flipped, checksum unchanged",
        ),
        "bad_format_version": (
            _rechecksum(version),
            "malformed",
            "the example with format version 2 (checksum recomputed)",
        ),
        "bad_zero_gap": (
            _rechecksum(zero_gap),
            "malformed",
            "the example with its first gap set to 0 (indices must increase; checksum recomputed)",
        ),
        "bad_truncated": (
            _rechecksum(bytearray(example[:-1])),
            "malformed",
            "the example without its last byte (checksum recomputed): shorter than its header says",
        ),
        "bad_zstd_trailing": (
            _rechecksum(_extend_last_zstd_plane(zstd_head, trailing)),
            "malformed",
            "bitmap_zstd with two bytes appended to its compressed plane and the plane's "
            "stored_bytes raised to match (a plane is exactly one zstd frame; checksum "
            "recomputed)",
        ),
        **_disagreeing(),
    }


def _extend_last_zstd_plane(head: bytearray, joined: bytes) -> bytearray:
    """The payload with two junk bytes after its first zstd plane (header adjusted)."""
    decoded = decode_payload(joined)
    infos = [s.info for item in decoded.items for s in (item.locations, item.values) if s]
    offset = 28 + 8  # prelude, counts
    data_at = len(head)
    for info in infos:
        offset += 9
        for plane in info.planes:
            if plane.codec is BufferCodec.ZSTD:
                struct.pack_into("<Q", head, offset, plane.stored_bytes + 2)
                out = bytearray(head + joined[len(head) : data_at + plane.stored_bytes])
                out += b"\x00\x00" + joined[data_at + plane.stored_bytes :]
                return out
            offset += 9
            data_at += plane.stored_bytes
    raise ValueError("no zstd plane")


def main() -> None:
    DATA.mkdir(exist_ok=True)
    for old in DATA.iterdir():
        old.unlink()
    index: dict[str, object] = {"dtype_codes": list(WIRE_DTYPES), "valid": [], "invalid": []}
    frames_of: dict[str, tuple[BytesLike, ...]] = {}
    valid: list[str] = []
    for name, make in TRACKER_CASES.items():
        case = make()
        payload = _tracker_payload(case)
        frames_of[name] = payload.frames
        meta = {
            "description": case.description,
            "writer": "tracker",
            "tracker": {
                "base": case.base,
                "target": case.target,
                "max_item_bytes": case.max_item_bytes,
            },
            **_payload_json(payload.frames),
            "tensors": _tensors_json(case),
        }
        _write(name, payload.frames, meta)
        valid.append(name)
    frames, description = _gaps_width8()
    meta = {"description": description, "writer": "build_payload", **_payload_json(frames)}
    meta["tensors"] = None
    _write("gaps_width8", frames, meta)
    valid.append("gaps_width8")
    example = b"".join(memoryview(f).cast("B") for f in frames_of["example"])
    invalid = []
    for name, (data, error, what) in _invalid(example, frames_of["bitmap_zstd"]).items():
        (DATA / f"{name}.rfdz").write_bytes(data)
        invalid.append({"name": name, "error": error, "description": what})
    reserved = bytearray(example)
    reserved[6:8] = struct.pack("<H", 1)
    (DATA / "reserved_set.rfdz").write_bytes(_rechecksum(reserved))
    index["valid"] = valid
    index["invalid"] = invalid
    index["equivalent"] = [
        {
            "name": "reserved_set",
            "decodes_like": "example",
            "description": "the example with the reserved prelude field set to 1 (checksum "
            "recomputed): readers ignore the field, so it decodes to the example's items",
        }
    ]
    (DATA / "index.json").write_text(_dumps(index), encoding="utf-8")


if __name__ == "__main__":
    main()
