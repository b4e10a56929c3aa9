"""UndoArena: pieces never overlap within a transfer and fill every block; blocks are reused
after it, up to a cap."""

from __future__ import annotations

import numpy as np

from refit_zmq.codec.undo_arena import UndoArena


def test_pieces_are_distinct_memory_until_recycled_and_fill_their_blocks() -> None:
    arena = UndoArena(max_pooled_bytes=8 * 1024, block_bytes=4 * 1024)
    pieces = [arena.take(1000) for _ in range(9)]
    assert [p.nbytes for p in pieces] == [1000] * 4 + [96] + [1000] * 4, "a block's rest"
    pieces += [arena.take(10_000), arena.take(10_000)]
    assert [p.nbytes for p in pieces[-2:]] == [96, 4096], (
        "the rest of a block, then at most a block"
    )
    for index, piece in enumerate(pieces):
        piece[:] = index
    assert [int(p[0]) for p in pieces] == list(range(11)), "no piece shares another's memory"
    assert [int(p[-1]) for p in pieces] == list(range(11))
    arena.recycle()
    assert arena.pooled_bytes == 8 * 1024, "at most the cap is kept"
    reused = arena.take(4096)
    assert any(np.shares_memory(reused, p) for p in pieces), "a kept block serves again"
    arena.recycle()
    assert arena.pooled_bytes == 8 * 1024
