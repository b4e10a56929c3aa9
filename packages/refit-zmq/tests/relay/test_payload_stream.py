"""PayloadStream: a payload applied as its bytes arrive, in chunks of any size."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from relay_helpers import KiB, MiB, Trainer, digests, make_state

from refit_core import (
    ChecksumMismatchError,
    GeometryMismatchError,
    ProtocolError,
    TensorSpec,
    WeightVersion,
)
from refit_zmq.codec import DeltaPayload, UndoLog, apply_payload
from refit_zmq.codec.format import PayloadHasher
from refit_zmq.relay.apply import payload_stream
from refit_zmq.relay.apply.payload_stream import PayloadStream
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig


@pytest.fixture(params=["resync", "delta"])
def payloads(request: pytest.FixtureRequest) -> Iterator[tuple[list[DeltaPayload], int | None]]:
    """A dense resync (raw items written straight from the chunks) or a 5% delta (sparse and
    compressed items, gathered whole), with the version the receiver must hold."""
    trainer = Trainer(make_state(1), version=3, bucket_bytes=512 * KiB)
    try:
        resync = request.param == "resync"
        trainer.step(5, density=0.05)
        encoded = trainer.shards[0].tracker.encode(trainer.state, WeightVersion(4), resync=resync)
        yield list(encoded), None if resync else 3
    finally:
        trainer.close()


def _stream(tensors: dict[str, torch.Tensor], version: int | None, **kw: object) -> PayloadStream:
    current = None if version is None else WeightVersion(version)
    options = {
        "admit": lambda layout: None,
        "candidates": 64,
        "rng": np.random.default_rng(0),
        "chunked": False,  # pieces of any size; the frame rule has its own test
    }
    options.update(kw)
    return PayloadStream(tensors, current, **options)  # type: ignore[arg-type]


def _cuts(data: bytes, sizes: list[int]) -> Iterator[memoryview]:
    view = memoryview(data)
    at = 0
    index = 0
    while at < len(view):
        size = sizes[index % len(sizes)]
        yield view[at : at + size]
        at += size
        index += 1


@pytest.mark.parametrize("sizes", [[1 << 30], [4096], [3, 5000, 17, 65536], [7]])
def test_any_chunking_gives_the_bits_of_a_whole_apply(
    payloads: tuple[list[DeltaPayload], int | None], sizes: list[int]
) -> None:
    encoded, version = payloads
    if sizes == [7] and version is None:
        encoded = encoded[:1]  # byte-sized pieces of a whole resync take long; one payload
    expected = make_state(1 if version is not None else 2)
    streamed = make_state(1 if version is not None else 2)
    current = None if version is None else WeightVersion(version)
    for payload in encoded:
        apply_payload(payload, expected, current)
        stream = _stream(streamed, version)
        for piece in _cuts(payload.to_bytes(), sizes):
            stream.feed(piece)
        result = stream.finish(payload.checksum)
        assert result.nbytes == payload.nbytes and result.verified > 0
    assert digests(streamed) == digests(expected)


@pytest.mark.parametrize("where", [0.5, 40, 100])
def test_a_corrupted_byte_is_reported_as_such_and_every_write_undone(
    payloads: tuple[list[DeltaPayload], int | None], where: float
) -> None:
    """In the body the checksum finds it at the end; in frame 0 it may break the header
    first (a wrong shape, an unknown dtype), and is still reported as corruption."""
    encoded, version = payloads
    payload = max(encoded, key=lambda p: p.nbytes)
    data = bytearray(payload.to_bytes())
    data[int(len(data) * where) if where < 1 else int(where)] ^= 0xFF
    tensors = make_state(1)
    before = digests(tensors)
    stream = _stream(tensors, version)
    for piece in _cuts(bytes(data), [64 * KiB]):
        stream.feed(piece)
    with pytest.raises(ChecksumMismatchError):
        stream.finish(payload.checksum)
    assert digests(tensors) == before and len(stream.undo) == 0


def test_a_declared_checksum_that_differs_undoes_the_payload(
    payloads: tuple[list[DeltaPayload], int | None],
) -> None:
    encoded, version = payloads
    tensors = make_state(1)
    before = digests(tensors)
    stream = _stream(tensors, version)
    stream.feed(memoryview(encoded[0].to_bytes()))
    with pytest.raises(ChecksumMismatchError):
        stream.finish("0" * 32)
    assert digests(tensors) == before


def test_an_abandoned_payload_is_undone(payloads: tuple[list[DeltaPayload], int | None]) -> None:
    encoded, version = payloads
    payload = max(encoded, key=lambda p: p.nbytes)
    tensors = make_state(1)
    before = digests(tensors)
    stream = _stream(tensors, version)
    data = payload.to_bytes()
    stream.feed(memoryview(data)[: len(data) - 1])
    stream.abandon()
    assert digests(tensors) == before


@pytest.mark.parametrize("fail_at", [2, 7, 30])
def test_a_write_interrupted_inside_a_run_of_undo_memory_is_undone(
    fail_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw resync (its items written straight from the chunks) in small blocks, so one run
    of undo memory spans many of them; hashing a block fails after the blocks before it
    were written: every one of them is rolled back."""
    tracker = DeltaCompressionTracker(
        {name: TensorSpec.of(t) for name, t in make_state(1).items()},
        TrackerConfig(bucket_size_bytes=512 * KiB, max_item_bytes=256 * KiB, compress=False),
    )
    with tracker:
        payload = max(tracker.encode(make_state(2), WeightVersion(1)), key=lambda p: p.nbytes)
    tensors = make_state(1)
    before = digests(tensors)
    stream = _stream(tensors, None)
    monkeypatch.setattr(payload_stream, "BLOCK_BYTES", 1024)
    hashed = 0
    update = PayloadHasher.update

    def failing(self: PayloadHasher, data: memoryview) -> None:
        nonlocal hashed
        hashed += 1
        if hashed == fail_at:
            raise RuntimeError("interrupted")
        update(self, data)

    monkeypatch.setattr(PayloadHasher, "update", failing)
    for piece in _cuts(payload.to_bytes(), [300 * KiB]):
        stream.feed(piece)
    with pytest.raises(RuntimeError, match="interrupted"):
        stream.finish(payload.checksum)
    assert hashed > fail_at and digests(tensors) == before


def test_a_payload_cut_short_is_refused(payloads: tuple[list[DeltaPayload], int | None]) -> None:
    encoded, version = payloads
    tensors = make_state(1)
    before = digests(tensors)
    stream = _stream(tensors, version)
    data = encoded[0].to_bytes()
    stream.feed(memoryview(data)[:-10])
    with pytest.raises(ProtocolError, match="before its end"):
        stream.finish(encoded[0].checksum)
    stream = _stream(tensors, version)
    stream.feed(memoryview(data + b"extra"))
    with pytest.raises(ProtocolError, match="past its end"):
        stream.finish(encoded[0].checksum)
    assert digests(tensors) == before


def test_refusals_come_before_the_first_write(
    payloads: tuple[list[DeltaPayload], int | None],
) -> None:
    encoded, version = payloads
    tensors = make_state(1)
    tensors["embed.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    before = digests(tensors)
    stream = _stream(tensors, version)
    for payload in encoded:
        stream = _stream(tensors, version)
        stream.feed(memoryview(payload.to_bytes()))
        if any(item.name == "embed.weight" for item in payload.items):
            with pytest.raises(GeometryMismatchError, match="embed"):
                stream.finish(payload.checksum)
            assert digests(tensors) == before
            break
    else:
        pytest.fail("no payload carries embed.weight")

    def refuse(layout: object) -> None:
        raise ProtocolError("the receiver's own rule")

    fresh = make_state(1)
    untouched = digests(fresh)
    stream = _stream(fresh, version, admit=refuse)
    stream.feed(memoryview(encoded[0].to_bytes()))
    with pytest.raises(ProtocolError, match="own rule"):
        stream.finish(encoded[0].checksum)
    assert digests(fresh) == untouched and len(stream.undo) == 0


def test_undo_of_a_finished_stream_restores_the_old_bits() -> None:
    trainer = Trainer(make_state(1), version=0, bucket_bytes=4 * MiB)
    try:
        (payload,) = trainer.shards[0].tracker.encode(make_state(3), WeightVersion(1), resync=True)
    finally:
        trainer.close()
    tensors = make_state(1)
    before = digests(tensors)
    stream = _stream(tensors, None)
    for piece in _cuts(payload.to_bytes(), [10_000]):
        stream.feed(piece)
    stream.finish(payload.checksum)
    stream.abandon()
    assert digests(tensors) == digests(make_state(3)), "a finished payload is not abandoned"
    undo = UndoLog(list(stream.undo.entries))
    undo.restore()
    assert digests(tensors) == before


def test_a_chunk_holding_bytes_of_two_frames_is_refused_and_undone(
    payloads: tuple[list[DeltaPayload], int | None],
) -> None:
    encoded, version = payloads
    payload = max(encoded, key=lambda p: p.nbytes)
    frames = [bytes(memoryview(frame).cast("B")) for frame in payload.frames]
    tensors = make_state(1 if version is not None else 2)
    before = digests(tensors)
    aligned = _stream(tensors, version, chunked=True)
    for frame in frames:
        aligned.feed(frame)
    aligned.finish(payload.checksum)
    assert digests(tensors) != before, "frame-aligned chunks apply"
    aligned.undo.restore()

    for split in (0, len(frames) - 2):  # frame 0 with the next frame's first byte, or later
        crossing = _stream(tensors, version, chunked=True)
        for index, frame in enumerate(frames):
            if index == split:
                crossing.feed(frame + frames[index + 1][:1])
            elif index == split + 1:
                crossing.feed(frame[1:])
            else:
                crossing.feed(frame)
        with pytest.raises(ProtocolError, match="two frames"):
            crossing.finish(payload.checksum)
        assert digests(tensors) == before, "nothing of the payload may stay applied"
