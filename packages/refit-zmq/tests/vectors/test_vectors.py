"""The RFDZ test vectors: an independent reader and refit's codec agree on every byte.

``rfdz_reader`` is written from CODEC.md alone; that it decodes every vector exactly as the
JSON (made by refit) says, and refuses every invalid one, is what shows the specification is
complete. Refit's codec must decode the same, apply the same bits, and re-encode each
payload to the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rfdz_reader
import torch
import xxhash

from refit_core import ChecksumMismatchError, ProtocolError, TensorSpec, WeightVersion
from refit_zmq.codec import Encoding, UndoLog, apply_payload, decode_payload, unpack_buffer
from refit_zmq.codec.buffers import pack_buffer
from refit_zmq.codec.dtypes import WIRE_DTYPES, unsigned_numpy_dtype
from refit_zmq.codec.format import build_payload
from refit_zmq.codec.locations import decode_locations
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

DATA = Path(__file__).resolve().parent / "data"
INDEX: dict[str, Any] = json.loads((DATA / "index.json").read_text(encoding="utf-8"))
VALID: list[str] = INDEX["valid"]
INVALID: list[dict[str, str]] = INDEX["invalid"]


def _vector(name: str) -> tuple[bytes, dict[str, Any]]:
    meta = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    return (DATA / f"{name}.rfdz").read_bytes(), meta


def _frames(data: bytes, sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for size in sizes:
        out.append(data[at : at + size])
        at += size
    assert at == len(data)
    return out


def _before_bits(entry: dict[str, Any]) -> bytearray:
    itemsize = getattr(torch, entry["dtype"]).itemsize
    numel = int(np.prod(entry["shape"], dtype=np.int64))
    before = entry["before"]
    if isinstance(before, dict):
        return bytearray(bytes.fromhex(before["fill"]) * numel)
    bits = bytearray.fromhex(before)
    assert len(bits) == numel * itemsize
    return bits


def _tensor(entry: dict[str, Any], bits: bytes) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    raw = torch.frombuffer(bytearray(bits), dtype=torch.uint8) if bits else torch.empty(0)
    return raw.to(torch.uint8).view(dtype).reshape(entry["shape"]).clone()


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _codec_read(data: bytes) -> None:
    """Everything refit's codec reads of a payload before applying it."""
    for item in decode_payload(data).items:
        raw = None if item.locations is None else unpack_buffer(item.locations)
        decode_locations(item.header, raw)
        if item.values is not None:
            unpack_buffer(item.values)


def test_index_lists_every_file_and_the_dtype_codes() -> None:
    named = {*VALID, *(v["name"] for v in INVALID), *(v["name"] for v in INDEX["equivalent"])}
    on_disk = {path.stem for path in DATA.glob("*.rfdz")}
    assert named == on_disk
    assert INDEX["dtype_codes"] == list(WIRE_DTYPES)
    assert [name for name, _ in rfdz_reader.DTYPES] == list(WIRE_DTYPES)


@pytest.mark.parametrize("name", VALID)
def test_independent_reader_matches_the_json(name: str) -> None:
    data, meta = _vector(name)
    payload = rfdz_reader.read(data)
    assert (
        payload.checksum == meta["checksum"] == xxhash.xxh3_128(data[:12] + data[28:]).hexdigest()
    )
    assert list(payload.frames) == meta["frames"]
    assert [
        {
            "raw_bytes": b.raw_bytes,
            "planes": [{"stored_bytes": p.stored_bytes, "codec": p.codec} for p in b.planes],
        }
        for b in payload.buffers
    ] == meta["buffers"]
    for item, want in zip(payload.items, meta["items"], strict=True):
        got = {
            "name": item.name,
            "dtype": item.dtype,
            "dtype_code": item.dtype_code,
            "shape": list(item.shape),
            "span_start": item.span_start,
            "span_stop": item.span_stop,
            "encoding": item.encoding,
            "encoding_code": rfdz_reader.ENCODINGS.index(item.encoding),
            "gap_width": item.gap_width,
            "first": item.first,
            "count": item.count,
            "base": item.base,
            "target": item.target,
            "buffers": list(item.buffers),
            "writes": [[index, value.hex()] for index, value in item.writes],
        }
        assert got == want


@pytest.mark.parametrize("name", [n for n in VALID if _vector(n)[1]["tensors"] is not None])
def test_both_readers_apply_the_same_bits(name: str) -> None:
    data, meta = _vector(name)
    tensors = meta["tensors"]
    independent = {n: _before_bits(entry) for n, entry in tensors.items()}
    rfdz_reader.apply(rfdz_reader.read(data), independent)
    receiver = {n: _tensor(entry, _before_bits(entry)) for n, entry in tensors.items()}
    base = meta["items"][0]["base"]
    current = WeightVersion(base) if base is not None else None
    for form in (data, _frames(data, meta["frames"])):
        undo = UndoLog()
        apply_payload(form, receiver, current, undo=undo)
        for n, entry in tensors.items():
            after = _raw(receiver[n])
            assert after == bytes(independent[n])
            assert xxhash.xxh3_64(after).hexdigest() == entry["after_xxh3_64"]
            if "after" in entry:
                assert after.hex() == entry["after"]
        undo.restore()
        for n, entry in tensors.items():
            assert _raw(receiver[n]) == bytes(_before_bits(entry))


@pytest.mark.parametrize("name", VALID)
def test_codec_decodes_what_the_independent_reader_does(name: str) -> None:
    data, meta = _vector(name)
    independent = rfdz_reader.read(data)
    for form in (data, _frames(data, meta["frames"])):
        decoded = decode_payload(form)
        assert decoded.nbytes == len(data)
        for item, want in zip(decoded.items, independent.items, strict=True):
            h = item.header
            assert (h.name, str(h.dtype), h.shape) == (want.name, f"torch.{want.dtype}", want.shape)
            assert (h.span_start, h.span_stop, h.encoding.name) == (
                want.span_start,
                want.span_stop,
                want.encoding,
            )
            assert (h.first, h.count, h.gap_width) == (want.first, want.count, want.gap_width)
            assert (None if h.base is None else h.base.value, h.target.value) == (
                want.base,
                want.target,
            )
            stored = [s for s in (item.locations, item.values) if s is not None]
            assert [s.info.raw_bytes for s in stored] == [
                independent.buffers[b].raw_bytes for b in want.buffers
            ]


@pytest.mark.parametrize("name", VALID)
def test_codec_rebuilds_every_payload_byte_for_byte(name: str) -> None:
    data, _ = _vector(name)
    decoded = decode_payload(data)
    buffers = []
    for item in decoded.items:
        h = item.header
        location_width = h.gap_width if h.encoding is Encoding.GAPS else 1
        for stored, width in ((item.locations, location_width), (item.values, h.itemsize)):
            if stored is not None:
                raw = unpack_buffer(stored).view(unsigned_numpy_dtype(width))
                buffers.append(pack_buffer(raw, compress=True))
    rebuilt = build_payload([i.header for i in decoded.items], buffers, changed_elements=0)
    assert rebuilt.to_bytes() == data


@pytest.mark.parametrize("name", [n for n in VALID if _vector(n)[1]["writer"] == "tracker"])
def test_tracker_reencodes_the_tensors_to_the_same_bytes(name: str) -> None:
    data, meta = _vector(name)
    setup = meta["tracker"]
    tensors = meta["tensors"]
    before = {n: _tensor(entry, _before_bits(entry)) for n, entry in tensors.items()}
    after = {n: t.clone() for n, t in before.items()}
    apply_payload(data, after, None if setup["base"] is None else WeightVersion(setup["base"]))
    spec = {n: TensorSpec.of(t) for n, t in after.items()}
    config = TrackerConfig(threads=2, max_item_bytes=setup["max_item_bytes"])
    with DeltaCompressionTracker(spec, config) as tracker:
        if setup["base"] is not None:
            tracker.load_baseline(before, WeightVersion(setup["base"]))
        (payload,) = tracker.encode(after, WeightVersion(setup["target"]))
        assert payload.to_bytes() == data


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_both_readers_refuse_the_invalid_vectors(vector: dict[str, str]) -> None:
    data = (DATA / f"{vector['name']}.rfdz").read_bytes()
    independent, codec = {
        "checksum": (rfdz_reader.ChecksumMismatchError, ChecksumMismatchError),
        "malformed": (rfdz_reader.MalformedError, ProtocolError),
    }[vector["error"]]
    with pytest.raises(independent):
        rfdz_reader.read(data)
    with pytest.raises(codec) as refused:
        _codec_read(data)
    if vector["error"] == "malformed":
        assert not isinstance(refused.value, ChecksumMismatchError)


@pytest.mark.parametrize("vector", INDEX["equivalent"], ids=lambda v: v["name"])
def test_ignored_fields_decode_alike(vector: dict[str, str]) -> None:
    data = (DATA / f"{vector['name']}.rfdz").read_bytes()
    like, _ = _vector(vector["decodes_like"])
    assert rfdz_reader.read(data).items == rfdz_reader.read(like).items
    assert [i.header for i in decode_payload(data).items] == [
        i.header for i in decode_payload(like).items
    ]
