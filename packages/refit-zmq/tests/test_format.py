"""Wire format: frames and joined bytes decode alike, malformed input is refused, no pickle."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch
import xxhash

from refit_core import ChecksumMismatchError, ProtocolError, TensorSpec, WeightVersion
from refit_zmq.codec import BufferCodec, DeltaPayload, Encoding, decode_payload
from refit_zmq.codec.buffers import pack_buffer, unpack_buffer
from refit_zmq.codec.format import MAGIC, ItemHeader, StoredBuffer, build_payload
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig


def _payload() -> DeltaPayload:
    gen = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(4096, generator=gen).to(torch.bfloat16), "b": torch.zeros(3, 5)}
    new = {"a": old["a"].clone(), "b": old["b"].clone()}
    new["a"][::50] += 1
    new["b"][1, 2] = -0.0
    spec = {name: TensorSpec.of(t) for name, t in old.items()}
    with DeltaCompressionTracker(spec, TrackerConfig(threads=1)) as tracker:
        tracker.load_baseline(old, WeightVersion(7))
        (payload,) = tracker.encode(new, WeightVersion(8))
        return payload


def test_header_carries_name_dtype_shape_encoding_and_versions() -> None:
    payload = _payload()
    decoded = decode_payload(payload)
    items = {item.header.name: item.header for item in decoded.items}
    assert items["a"].dtype == torch.bfloat16
    assert items["a"].shape == (4096,)
    assert items["a"].encoding is Encoding.GAPS
    assert items["b"].shape == (3, 5)
    assert items["b"].encoding is Encoding.RANGE
    assert items["b"].count == 1
    assert all(h.base == WeightVersion(7) and h.target == WeightVersion(8) for h in items.values())
    assert decoded.nbytes == payload.nbytes == len(payload.to_bytes())


def test_frames_and_joined_bytes_decode_alike() -> None:
    payload = _payload()
    from_frames = decode_payload(list(payload.frames))
    from_bytes = decode_payload(payload.to_bytes())
    assert [i.header for i in from_frames.items] == [i.header for i in from_bytes.items]


def test_checksum_is_the_xxh3_128_of_every_other_byte() -> None:
    data = _payload().to_bytes()
    want = xxhash.xxh3_128(data[:12] + data[28:]).hexdigest()
    assert _payload().checksum == want
    assert data[12:28].hex() == want


def test_bad_magic_is_a_protocol_error() -> None:
    data = bytearray(_payload().to_bytes())
    data[:4] = b"XXXX"
    with pytest.raises(ProtocolError, match="magic"):
        decode_payload(bytes(data))


@pytest.mark.parametrize("cut", [0, 10, 27, 40, -1])
def test_truncated_payloads_are_refused(cut: int) -> None:
    data = _payload().to_bytes()
    with pytest.raises((ProtocolError, ChecksumMismatchError)):
        decode_payload(data[:cut])


def test_missing_frame_is_refused() -> None:
    frames = list(_payload().frames)
    with pytest.raises((ProtocolError, ChecksumMismatchError)):
        decode_payload(frames[:-1])


def test_changed_version_byte_fails_the_checksum() -> None:
    payload = _payload()
    head = bytearray(payload.frames[0])
    head[4:6] = struct.pack("<H", 99)
    with pytest.raises(ChecksumMismatchError):
        decode_payload([bytes(head), *payload.frames[1:]])


def _item(**fields: object) -> ItemHeader:
    values: dict[str, object] = {
        "name": "t",
        "dtype": torch.float32,
        "shape": (10,),
        "span_start": 0,
        "span_stop": 10,
        "encoding": Encoding.RANGE,
        "first": 2,
        "count": 3,
        "gap_width": 0,
        "base": WeightVersion(1),
        "target": WeightVersion(2),
    }
    values.update(fields)
    return ItemHeader(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "buffer_bytes", "message"),
    [
        ({}, 8, "buffers do not match"),
        ({"span_stop": 11}, 12, "span outside"),
        ({"first": 9}, 12, "count/first"),
        ({"base": WeightVersion(2)}, 12, "target does not follow"),
        ({"base": None}, 12, "only DENSE"),
        ({"encoding": Encoding.GAPS, "gap_width": 3}, 12, "count/first"),
    ],
)
def test_checksummed_but_inconsistent_headers_are_protocol_errors(
    fields: dict[str, object], buffer_bytes: int, message: str
) -> None:
    values = np.zeros(buffer_bytes, dtype=np.uint8)
    payload = build_payload(
        [_item(**fields)], [pack_buffer(values, compress=False)], changed_elements=0
    )
    with pytest.raises(ProtocolError, match=message):
        decode_payload(payload.to_bytes())


def test_decoding_never_unpickles(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used while decoding")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    payload = _payload()
    assert MAGIC in payload.frames[0][:4]
    decode_payload(payload.to_bytes())


def test_compressible_planes_are_compressed_and_random_ones_stay_raw() -> None:
    rng = np.random.default_rng(0)
    values = (rng.integers(0, 4, 10_000) << 8 | rng.integers(0, 256, 10_000)).astype(np.uint16)
    info, data = pack_buffer(values, compress=True)
    assert [p.codec for p in info.planes] == [BufferCodec.RAW, BufferCodec.ZSTD]
    assert info.stored_bytes < values.nbytes
    restored = unpack_buffer(StoredBuffer(info, memoryview(data)))
    np.testing.assert_array_equal(restored.view(np.uint16), values)


def test_incompressible_buffers_are_sent_without_a_copy() -> None:
    values = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    info, data = pack_buffer(values, compress=True)
    assert [p.codec for p in info.planes] == [BufferCodec.RAW]
    assert np.shares_memory(np.frombuffer(data, dtype=np.uint8), values)


def test_compression_off_keeps_buffers_raw() -> None:
    values = np.zeros(10_000, dtype=np.uint16)
    info, _ = pack_buffer(values, compress=False)
    assert info.stored_bytes == values.nbytes
