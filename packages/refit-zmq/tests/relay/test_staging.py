"""Bounded staging: chunks written once in place, admission by budget, window and FIFO."""

from __future__ import annotations

import numpy as np
import pytest
from relay_helpers import Trainer, make_state

from refit_core.errors import ProtocolError
from refit_core.types import WeightVersion
from refit_zmq.relay.staging import Pending, StagedPayload, Staging


def _staged(payload: str, size: int, root: str = "r") -> StagedPayload:
    return StagedPayload(("t", "p", payload), "0" * 32, size, root, {}, b"peer")


def test_chunks_are_written_once_and_must_not_overlap() -> None:
    staged = _staged("0", 10)
    assert staged.write(0, memoryview(b"abcd"))
    assert not staged.write(0, memoryview(b"abcd")), "a repeated chunk is recognised"
    with pytest.raises(ProtocolError, match="overlaps"):
        staged.write(2, memoryview(b"xy"))
    with pytest.raises(ProtocolError, match="past"):
        staged.write(8, memoryview(b"xyz"))
    assert staged.write(6, memoryview(b"ghij")) and not staged.complete
    assert staged.write(4, memoryview(b"ef")) and staged.complete
    assert bytes(staged.buffer) == b"abcdefghij"
    assert [bytes(staged.chunk(i)) for i in range(3)] == [b"abcd", b"ghij", b"ef"]


def test_chunks_hashed_in_any_arrival_order_give_the_codecs_checksum() -> None:
    trainer = Trainer(make_state(1), version=0)
    try:
        tracker = trainer.shards[0].tracker
        payload, *_ = tracker.encode(trainer.state, WeightVersion(1), resync=True)
        tracker.abort()
    finally:
        trainer.close()
    data = payload.to_bytes()
    rng = np.random.default_rng(0)
    cuts = [0, 5, 12, 20, 28, 40, *sorted(rng.choice(range(41, len(data)), 30, replace=False))]
    chunks = list(zip(cuts, [*cuts[1:], len(data)], strict=True))
    staged = _staged("0", len(data))
    for at in rng.permutation(len(chunks)):
        start, end = chunks[at]
        with pytest.raises(ProtocolError, match="before every byte"):
            staged.digest()
        staged.write(start, memoryview(data)[start:end])
    assert staged.complete and staged.digest().hex() == payload.checksum


def test_admission_respects_budget_window_and_arrival_order() -> None:
    staging = Staging(budget_bytes=100, window=1, max_pending=3)
    staging.admit(_staged("a", 60, root="r"))
    staging.admit(_staged("b", 10, root="q"))
    assert not staging.fits(31, "other"), "over the byte budget"
    assert not staging.fits(1, "r"), "the tree's window is full"
    assert staging.fits(30, "other")
    for name, size, root in (("c", 50, "x"), ("d", 10, "q"), ("e", 10, "y")):
        assert staging.wait(Pending(("t", "p", name), size, root, {}, b"peer"))
    assert not staging.wait(Pending(("t", "p", "f"), 1, "z", {}, b"peer")), "queue is full"
    assert staging.admissible() == [], "the oldest waits for bytes, and the rest behind it"
    staging.release(staging.staged["t", "p", "a"])
    taken = [p.key[2] for p in staging.admissible()]
    assert taken == ["c", "e"], "d waits for its tree's window, e does not wait behind it"
    assert staging.peak_bytes == 70 and staging.reserved_bytes == 10
