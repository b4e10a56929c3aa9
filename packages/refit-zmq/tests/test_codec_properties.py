"""Property tests of the delta codec: exact bits through encode, apply, undo and corruption."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace as Helpers

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refit_core import (
    ChecksumMismatchError,
    ProtocolError,
    StaleBaseError,
    TensorSpec,
    WeightVersion,
)
from refit_zmq.codec import DeltaPayload, UndoLog, apply_payload, tensor_digest
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )
    if d is not None
)
DENSITIES = (0.0, 1e-4, 1e-2, 0.5, 1.0)
BASE = WeightVersion(3)
TARGET = WeightVersion(4)
LAYOUTS = ("contiguous", "transposed", "strided")


@dataclass(frozen=True)
class Case:
    """One randomly drawn refit."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    density: float
    special: bool
    source_layout: str
    target_layout: str
    seed: int
    chunk_bytes: int
    max_item_bytes: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    return Case(
        dtype=draw(st.sampled_from(DTYPES)),
        shape=tuple(draw(st.lists(st.integers(0, 48), max_size=3))),
        density=draw(st.sampled_from(DENSITIES)),
        special=draw(st.booleans()),
        source_layout=draw(st.sampled_from(LAYOUTS)),
        target_layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**32 - 1)),
        chunk_bytes=draw(st.sampled_from((64, 4096, 1 << 19))),
        max_item_bytes=draw(st.sampled_from((512, 1 << 20))),
    )


@dataclass
class Refit:
    """A tracker at ``BASE`` holding ``old`` (plus a small second tensor), and the payloads to ``new``."""

    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]
    payloads: list[DeltaPayload]
    tracker: DeltaCompressionTracker


def _refit(case: Case, helpers: Helpers) -> Refit:
    rng = np.random.default_rng(case.seed)
    old = {
        "w": helpers.random_tensor(rng, case.shape, case.dtype),
        "bias": helpers.random_tensor(rng, (7,), torch.bfloat16),
    }
    new = {
        name: helpers.changed(rng, t, case.density, special=case.special) for name, t in old.items()
    }
    spec = {name: TensorSpec.of(t) for name, t in old.items()}
    config = TrackerConfig(
        bucket_size_bytes=max(case.max_item_bytes, 2048),
        max_item_bytes=case.max_item_bytes,
        chunk_bytes=case.chunk_bytes,
        threads=2,
    )
    tracker = DeltaCompressionTracker(spec, config)
    tracker.load_baseline(
        {name: helpers.non_contiguous(t, case.source_layout) for name, t in old.items()}, BASE
    )
    source = {name: helpers.non_contiguous(t, case.source_layout) for name, t in new.items()}
    return Refit(old, new, list(tracker.encode(source, TARGET)), tracker)


def _receiver(refit: Refit, layout: str, helpers: Helpers) -> dict[str, torch.Tensor]:
    return {name: helpers.non_contiguous(t.clone(), layout) for name, t in refit.old.items()}


@given(case=cases())
def test_apply_reproduces_new_bits_and_undo_restores_old(case: Case, helpers: Helpers) -> None:
    refit = _refit(case, helpers)
    with refit.tracker:
        receiver = _receiver(refit, case.target_layout, helpers)
        undo = UndoLog()
        for payload in refit.payloads:
            applied = apply_payload(payload.to_bytes(), receiver, BASE, undo=undo)
            assert applied.targets == {TARGET}
        for name, tensor in receiver.items():
            assert helpers.same_bits(tensor, refit.new[name]), name
            assert tensor_digest(tensor) == tensor_digest(refit.new[name])
        for payload in refit.payloads:
            apply_payload(payload.frames, receiver, BASE, undo=undo)
        for name, tensor in receiver.items():
            assert helpers.same_bits(tensor, refit.new[name]), f"{name} after applying twice"
        undo.restore()
        for name, tensor in receiver.items():
            assert helpers.same_bits(tensor, refit.old[name]), f"{name} after undo"


@given(case=cases())
def test_commit_makes_new_the_baseline_and_abort_keeps_old(case: Case, helpers: Helpers) -> None:
    refit = _refit(case, helpers)
    with refit.tracker as tracker:
        changed = sum(p.changed_elements for p in refit.payloads)
        tracker.abort()
        again = list(tracker.encode(refit.new, TARGET))
        assert sum(p.changed_elements for p in again) == changed
        assert tracker.commit() == TARGET
        unchanged = list(tracker.encode(refit.new, TARGET.next()))
        assert sum(p.changed_elements for p in unchanged) == 0
        receiver = {name: t.clone() for name, t in refit.new.items()}
        for payload in unchanged:
            apply_payload(payload, receiver, TARGET)
        for name, tensor in receiver.items():
            assert helpers.same_bits(tensor, refit.new[name])


@given(case=cases(), data=st.data())
def test_any_flipped_byte_is_refused_before_touching_anything(
    case: Case, data: st.DataObject, helpers: Helpers
) -> None:
    refit = _refit(case, helpers)
    with refit.tracker:
        payload = data.draw(st.sampled_from(refit.payloads))
        corrupt = bytearray(payload.to_bytes())
        at = data.draw(st.integers(0, len(corrupt) - 1))
        corrupt[at] ^= data.draw(st.integers(1, 255))
        receiver = _receiver(refit, case.target_layout, helpers)
        with pytest.raises((ChecksumMismatchError, ProtocolError)):
            apply_payload(bytes(corrupt), receiver, BASE, undo=UndoLog())
        for name, tensor in receiver.items():
            assert helpers.same_bits(tensor, refit.old[name])


@given(case=cases(), held=st.sampled_from((None, WeightVersion(2), TARGET)))
def test_payload_for_another_base_is_refused_and_changes_nothing(
    case: Case, held: WeightVersion | None, helpers: Helpers
) -> None:
    refit = _refit(case, helpers)
    with refit.tracker:
        receiver = _receiver(refit, case.target_layout, helpers)
        for payload in refit.payloads:
            with pytest.raises(StaleBaseError):
                apply_payload(payload, receiver, held, undo=UndoLog())
        for name, tensor in receiver.items():
            assert helpers.same_bits(tensor, refit.old[name])


@given(case=cases())
def test_first_refit_is_a_dense_resync_any_receiver_accepts(case: Case, helpers: Helpers) -> None:
    rng = np.random.default_rng(case.seed)
    new = {"w": helpers.random_tensor(rng, case.shape, case.dtype)}
    config = TrackerConfig(max_item_bytes=case.max_item_bytes, bucket_size_bytes=1 << 20)
    with DeltaCompressionTracker({"w": TensorSpec.of(new["w"])}, config) as tracker:
        payloads = list(tracker.encode(new, TARGET))
        assert all(item.base is None for p in payloads for item in p.items)
        receiver = {"w": helpers.non_contiguous(torch.zeros_like(new["w"]), case.target_layout)}
        for payload in payloads:
            apply_payload(payload, receiver, None)
        assert helpers.same_bits(receiver["w"], new["w"])
        tracker.commit()
        assert tracker.version == TARGET
