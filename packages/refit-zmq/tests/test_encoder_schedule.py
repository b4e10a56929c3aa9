"""BucketEncoder's scheduling: ranges, coding on the worker that ends an item, failures."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from refit_core import TensorSpec, WeightVersion
from refit_zmq.codec import apply_payload
from refit_zmq.tracker import encoder as encoder_module
from refit_zmq.tracker.encoder import MAX_RANGE_BYTES, BucketEncoder, HostBits
from refit_zmq.tracker.plan import ItemSpan, plan_items

V0, V1 = WeightVersion(0), WeightVersion(1)


def _items(state: dict[str, torch.Tensor]) -> list[ItemSpan]:
    specs = {name: TensorSpec.of(tensor) for name, tensor in state.items()}
    return plan_items(specs, max_item_bytes=1 << 30)


def _bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.int16).reshape(-1).numpy().view(np.uint8)


def _encoder(pool: ThreadPoolExecutor, threads: int, chunk_bytes: int = 1024) -> BucketEncoder:
    return BucketEncoder(
        pool,
        threads=threads,
        chunk_bytes=chunk_bytes,
        base=V0,
        target=V1,
        dense=False,
        has_baseline=True,
        compress=True,
    )


@contextmanager
def _held(pool: ThreadPoolExecutor) -> Iterator[None]:
    """Keep the pool's only worker busy until the block ends (jobs queue up meanwhile)."""
    gate = threading.Event()
    pool.submit(gate.wait, 10.0)
    try:
        yield
    finally:
        gate.set()


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    old = {name: torch.randn(64, 64, generator=gen).to(torch.bfloat16) for name in "abc"}
    new = {name: tensor.clone() for name, tensor in old.items()}
    for tensor in new.values():
        tensor.view(-1)[::7] += 1.0
    return old, new


def test_an_item_is_coded_as_soon_as_its_last_range_is_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One worker, every item queued before it starts: each item's coding runs right after
    its own ranges, not behind the other items' comparisons."""
    old, new = _states()
    events: list[str] = []
    diff, code = encoder_module._diff, BucketEncoder._code

    def logged_diff(*args: object) -> object:
        events.append("compare")
        return diff(*args)  # type: ignore[arg-type]

    def logged_code(self: BucketEncoder, unit: object) -> object:
        events.append("code")
        return code(self, unit)  # type: ignore[arg-type]

    monkeypatch.setattr(encoder_module, "_diff", logged_diff)
    monkeypatch.setattr(BucketEncoder, "_code", logged_code)
    with ThreadPoolExecutor(1) as pool:
        encoder = _encoder(pool, threads=2)
        with _held(pool):
            for item in _items(old):
                encoder.add(item, _bits(old[item.name]).copy(), HostBits(_bits(new[item.name])))
        bucket = encoder.finish()
    assert events == ["compare", "compare", "code"] * 3
    receiver = {name: tensor.clone() for name, tensor in old.items()}
    apply_payload(bucket.payload, receiver, V0)
    assert all(torch.equal(receiver[n].view(torch.int16), new[n].view(torch.int16)) for n in new)


def test_a_failing_range_fails_its_item_and_the_bucket_without_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old, new = _states()
    diff = encoder_module._diff
    calls = 0

    def failing_diff(*args: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise MemoryError("range 3")
        return diff(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(encoder_module, "_diff", failing_diff)
    with ThreadPoolExecutor(2) as pool:
        encoder = _encoder(pool, threads=2)
        for item in _items(old):
            encoder.add(item, _bits(old[item.name]).copy(), HostBits(_bits(new[item.name])))
        with pytest.raises(MemoryError, match="range 3"):
            encoder.finish()
        encoder.settle()


def test_a_pool_shut_down_while_adding_fails_the_item_without_hanging() -> None:
    old, new = _states()
    pool = ThreadPoolExecutor(1)
    encoder = _encoder(pool, threads=2)
    item = _items(old)[0]
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        encoder.add(item, _bits(old[item.name]).copy(), HostBits(_bits(new[item.name])))
    encoder.settle()
    with pytest.raises(RuntimeError, match="shutdown"):
        encoder.finish()


@pytest.mark.parametrize("words", [1, 1000, 4 << 20, (9 << 20) + 5])
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_ranges_cover_the_item_in_whole_chunks_none_longer_than_the_cap(
    words: int, threads: int
) -> None:
    chunk = 1 << 13
    with ThreadPoolExecutor(1) as pool:
        ranges = _encoder(pool, threads, chunk_bytes=8 * chunk)._ranges(words, chunk, 8)
    assert ranges[0][0] == 0 and ranges[-1][1] == words
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(start % chunk == 0 for start, _ in ranges)
    assert all((stop - start) * 8 <= MAX_RANGE_BYTES for start, stop in ranges)
