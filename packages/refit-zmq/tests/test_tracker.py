"""DeltaCompressionTracker: commit/abort, sharding, buckets, storage and misuse."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refit_core import GeometryMismatchError, NamedTensor, TensorSpec, WeightVersion
from refit_core.sources import StateDictSource
from refit_zmq.codec import UndoLog, apply_payload
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig, plan_items, shard_items

V0, V1, V2 = WeightVersion(0), WeightVersion(1), WeightVersion(2)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "qkv": torch.randn(96, 64, generator=gen).to(torch.bfloat16),
        "norm": torch.ones(64),
        "step": torch.tensor([3], dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }


def _step(state: dict[str, torch.Tensor], every: int = 37) -> dict[str, torch.Tensor]:
    new = {name: t.clone() for name, t in state.items()}
    new["embed"].view(-1)[::every] += 0.25
    new["qkv"].view(-1)[5::every] -= 0.5
    new["step"] += 1
    return new


def _spec(state: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(t) for name, t in state.items()}


def _tracker(state: dict[str, torch.Tensor], **config: object) -> DeltaCompressionTracker:
    return DeltaCompressionTracker(_spec(state), TrackerConfig(**config))  # type: ignore[arg-type]


def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def test_refit_sequence_through_a_receiver() -> None:
    states = [_state()]
    for seed in range(1, 4):
        states.append(_step(states[-1], every=30 + seed))
    receiver = {name: torch.zeros_like(t) for name, t in states[0].items()}
    held: WeightVersion | None = None
    with _tracker(states[0], threads=2) as tracker:
        for version, state in enumerate(states, start=1):
            for payload in tracker.encode(state, WeightVersion(version)):
                apply_payload(payload, receiver, held)
            held = tracker.commit()
            assert all(_exact(receiver[n], state[n]) for n in state)


def test_aborted_refit_is_resent_in_full_by_the_next_one() -> None:
    old = _state()
    mid, new = _step(old, 41), _step(_step(old, 41), 43)
    with _tracker(old) as tracker:
        tracker.load_baseline(old, V0)
        lost = list(tracker.encode(mid, V1))
        assert sum(p.changed_elements for p in lost) > 0
        tracker.abort()
        assert tracker.version == V0 and tracker.pending is None
        receiver = {name: t.clone() for name, t in old.items()}
        for payload in tracker.encode(new, V2):
            apply_payload(payload, receiver, V0)
        tracker.commit()
        assert all(_exact(receiver[n], new[n]) for n in new)


def test_weight_source_stream_is_accepted() -> None:
    old = _state()
    source = StateDictSource(_step(old))
    with _tracker(old) as tracker:
        tracker.load_baseline(old, V0)
        payloads = list(tracker.encode(source.iter_tensors(), V1))
        assert sum(p.changed_elements for p in payloads) > 0


def test_resync_sends_every_item_dense_without_a_base() -> None:
    old = _state()
    with _tracker(old) as tracker:
        tracker.load_baseline(old, V0)
        payloads = list(tracker.encode(_step(old), V1, resync=True))
        items = [item for p in payloads for item in p.items]
        assert {item.base for item in items} == {None}
        assert all(item.count == item.span_len for item in items)
        receiver = {name: torch.full_like(t, 7) for name, t in old.items()}
        for payload in payloads:
            apply_payload(payload, receiver, WeightVersion(5))
        tracker.commit()
        assert all(_exact(receiver[n], t) for n, t in _step(old).items())
        assert sum(p.changed_elements for p in tracker.encode(_step(old), V2)) == 0


@pytest.mark.parametrize("shard_count", [1, 2, 3, 5])
def test_shards_together_send_every_element_exactly_once(shard_count: int) -> None:
    state = _state()
    spec = _spec(state)
    covered: dict[str, list[tuple[int, int]]] = {}
    for rank in range(shard_count):
        for item in shard_items(
            spec, shard_rank=rank, shard_count=shard_count, max_item_bytes=4096
        ):
            covered.setdefault(item.name, []).append((item.start, item.stop))
    for name, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == spec[name].numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert covered.keys() == spec.keys()


def test_shard_plan_does_not_depend_on_dict_order() -> None:
    spec = _spec(_state())
    reordered = dict(reversed(list(spec.items())))
    for rank in range(3):
        mine = shard_items(spec, shard_rank=rank, shard_count=3, max_item_bytes=4096)
        theirs = shard_items(reordered, shard_rank=rank, shard_count=3, max_item_bytes=4096)
        assert sorted((i.name, i.start) for i in mine) == sorted((i.name, i.start) for i in theirs)


def test_sharded_producers_rebuild_the_state_together() -> None:
    old, new = _state(), _step(_state())
    receiver = {name: t.clone() for name, t in old.items()}
    for rank in range(3):
        config = TrackerConfig(
            shard_rank=rank, shard_count=3, max_item_bytes=4096, bucket_size_bytes=8192
        )
        with DeltaCompressionTracker(_spec(old), config) as tracker:
            tracker.load_baseline(old, V0)
            for payload in tracker.encode(new, V1):
                apply_payload(payload, receiver, V0)
            tracker.commit()
    assert all(_exact(receiver[n], new[n]) for n in new)


def test_buckets_bound_the_dense_input_per_payload() -> None:
    old = _state()
    with _tracker(old, bucket_size_bytes=10_000, max_item_bytes=8192) as tracker:
        tracker.load_baseline(old, V0)
        payloads = list(tracker.encode(_step(old), V1))
        assert len(payloads) > 3
        assert all(p.dense_bytes <= 10_000 for p in payloads)
        spans = sorted((i.name, i.span_start, i.span_stop) for p in payloads for i in p.items)
        expected = sorted(
            (i.name, i.start, i.stop) for i in plan_items(_spec(old), max_item_bytes=8192)
        )
        assert spans == expected


def test_mmap_baseline_lives_in_the_directory_and_is_removed(tmp_path: Path) -> None:
    old = _state()
    tracker = _tracker(old, baseline_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # made on first use
    tracker.load_baseline(old, V0)
    assert len(list(tmp_path.iterdir())) == 1
    receiver = {name: t.clone() for name, t in old.items()}
    for payload in tracker.encode(_step(old), V1):
        apply_payload(payload, receiver, V0)
    tracker.commit()
    assert all(_exact(receiver[n], t) for n, t in _step(old).items())
    tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_missing_tensor_aborts_the_refit() -> None:
    old = _state()
    partial = {name: t for name, t in _step(old).items() if name != "qkv"}
    with _tracker(old) as tracker:
        tracker.load_baseline(old, V0)
        with pytest.raises(GeometryMismatchError, match="qkv"):
            list(tracker.encode(partial, V1))
        assert tracker.pending is None and tracker.version == V0


@pytest.mark.parametrize(
    "bad",
    [
        {"embed": torch.zeros(300, 65, dtype=torch.bfloat16)},
        {"embed": torch.zeros(300, 64)},
        {"unknown": torch.zeros(3)},
    ],
)
def test_mismatched_tensors_are_geometry_errors(bad: dict[str, torch.Tensor]) -> None:
    old = _state()
    with _tracker(old) as tracker:
        tracker.load_baseline(old, V0)
        with pytest.raises(GeometryMismatchError):
            list(tracker.encode({**_step(old), **bad}, V1))
        assert tracker.pending is None


def test_duplicate_tensor_in_a_stream_is_refused() -> None:
    old = _state()

    def stream() -> Iterator[NamedTensor]:
        for name, tensor in old.items():
            yield NamedTensor(name, tensor)
        yield NamedTensor("norm", old["norm"])

    with _tracker(old) as tracker:
        tracker.load_baseline(old, V0)
        with pytest.raises(GeometryMismatchError, match="twice"):
            list(tracker.encode(stream(), V1))


def test_misuse_is_refused() -> None:
    old = _state()
    with _tracker(old) as tracker:
        with pytest.raises(RuntimeError, match="commit"):
            tracker.commit()
        tracker.load_baseline(old, V1)
        with pytest.raises(ValueError, match="increase"):
            tracker.encode(old, V1)
        payloads = tracker.encode(old, V2)
        with pytest.raises(RuntimeError, match="pending"):
            tracker.encode(old, WeightVersion(3))
        with pytest.raises(RuntimeError, match="commit"):
            tracker.commit()
        list(payloads)
        assert tracker.commit() == V2


def test_abandoned_iteration_aborts() -> None:
    old = _state()
    with _tracker(old, bucket_size_bytes=10_000, max_item_bytes=8192) as tracker:
        tracker.load_baseline(old, V0)
        payloads = tracker.encode(_step(old), V1)
        next(payloads)
        payloads.close()
        assert tracker.pending is None and tracker.version == V0


def test_undo_log_rolls_back_a_multi_payload_transaction() -> None:
    old = _state()
    new = _step(old)
    receiver = {name: t.clone() for name, t in old.items()}
    undo = UndoLog()
    with _tracker(old, bucket_size_bytes=10_000, max_item_bytes=8192) as tracker:
        tracker.load_baseline(old, V0)
        for payload in tracker.encode(new, V1):
            apply_payload(payload, receiver, V0, undo=undo)
    assert len(undo) > 1 and undo.nbytes > 0
    undo.restore()
    assert len(undo) == 0
    assert all(_exact(receiver[n], old[n]) for n in old)
