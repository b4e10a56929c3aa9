"""The ordering guard refuses, at once, any overlap of gathers and consumer collectives."""

from __future__ import annotations

import threading

import pytest
import torch

from refit_core.sources import (
    CollectiveOrderError,
    CollectiveOrderGuard,
    DTensorSource,
    ShardedWeightSource,
    StateDictSource,
    WeightSource,
)

WAIT_S = 10.0


def test_sequential_use_alternates_freely() -> None:
    guard = CollectiveOrderGuard()
    for _ in range(3):
        with guard.gather():
            pass
        with guard.consumer_turn(), guard.consumer_turn():
            pass


def test_consumer_turn_during_a_gather_is_refused() -> None:
    guard = CollectiveOrderGuard()
    refused = pytest.raises(CollectiveOrderError, match="while the source is gathering")
    with guard.gather(), refused, guard.consumer_turn():
        pass
    with guard.gather(), pytest.raises(CollectiveOrderError, match="two gathers"), guard.gather():
        pass
    with guard.consumer_turn():
        pass


def test_resuming_the_source_while_a_consumer_collective_runs_is_refused() -> None:
    """A consumer that sends bucket i on a thread while it asks for bucket i + 1 (the
    pattern that deadlocks FSDP refits) gets an error instead of a silent reorder."""
    source = DTensorSource({"a": torch.ones(2), "b": torch.ones(2)})
    assert isinstance(source, ShardedWeightSource)
    in_turn, release = threading.Event(), threading.Event()

    def send() -> None:
        with source.order_guard.consumer_turn():
            in_turn.set()
            release.wait(WAIT_S)

    buckets = source.iter_buckets()
    next(buckets)
    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert in_turn.wait(WAIT_S)
        with pytest.raises(CollectiveOrderError, match="still running"):
            next(buckets)
    finally:
        release.set()
        sender.join(WAIT_S)
    assert not sender.is_alive()


def test_a_guard_shared_by_two_sources_refuses_overlapping_gathers() -> None:
    guard = CollectiveOrderGuard()
    first = DTensorSource({"a": torch.ones(1)}, order_guard=guard)
    second = DTensorSource({"b": torch.ones(1)}, order_guard=guard)
    assert first.order_guard is second.order_guard is guard
    with guard.gather(), pytest.raises(CollectiveOrderError):
        next(second.iter_buckets())
    assert [t.name for t in first.iter_tensors()] == ["a"]


def test_the_plain_source_is_a_weight_source_but_not_a_sharded_one() -> None:
    source = StateDictSource({"a": torch.ones(1)})
    assert isinstance(source, WeightSource)
    assert not isinstance(source, ShardedWeightSource)
