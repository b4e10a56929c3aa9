"""Bounded staging: chunks kept once, as received, admission by budget, window and FIFO."""

from __future__ import annotations

import numpy as np
import pytest

from refit_core import ProtocolError
from refit_zmq.relay.node.staging import Pending, StagedPayload, Staging


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
    assert staged.joined() == b"abcdefghij"
    assert [bytes(staged.chunk(i)) for i in range(3)] == [b"abcd", b"ghij", b"ef"]
    assert staged.at(4) is not None and staged.at(5) is None


def test_chunks_in_any_arrival_order_read_back_in_payload_order() -> None:
    data = np.random.default_rng(0).bytes(5000)
    rng = np.random.default_rng(1)
    cuts = [0, 5, 12, 20, 28, 40, *sorted(rng.choice(range(41, len(data)), 30, replace=False))]
    chunks = list(zip(cuts, [*cuts[1:], len(data)], strict=True))
    staged = _staged("0", len(data))
    for at in rng.permutation(len(chunks)):
        start, end = chunks[at]
        staged.write(int(start), memoryview(data)[start:end])
    fed = bytearray()
    while (chunk := staged.at(len(fed))) is not None:
        fed += chunk
    assert staged.complete and bytes(fed) == data == staged.joined()


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
