"""apply_payload: refusals touch nothing, digests match the trainer's, devices."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from refit_core import GeometryMismatchError, StaleBaseError, TensorSpec, WeightVersion
from refit_lab.digest import tensor_digest as trainer_digest
from refit_zmq.codec import DeltaPayload, UndoLog, apply_payload, tensor_digest
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

V0, V1 = WeightVersion(0), WeightVersion(1)


def _pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    old = {
        "w": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
        "b": torch.randn(32, generator=gen),
    }
    new = {name: t.clone() for name, t in old.items()}
    new["w"][::3, ::5] = float("nan")
    new["b"][7] = -0.0
    return old, new


def _payloads(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[DeltaPayload]:
    spec = {name: TensorSpec.of(t) for name, t in old.items()}
    with DeltaCompressionTracker(spec, TrackerConfig(threads=1)) as tracker:
        tracker.load_baseline(old, V0)
        return list(tracker.encode(new, V1))


def _unchanged(receiver: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> bool:
    return all(tensor_digest(receiver[n]) == tensor_digest(old[n]) for n in old)


def test_digests_match_the_trainer_side_digest() -> None:
    old, new = _pair()
    receiver = {name: t.clone() for name, t in old.items()}
    (payload,) = _payloads(old, new)
    applied = apply_payload(payload, receiver, V0)
    digests = applied.digests()
    assert digests == {name: trainer_digest(t) for name, t in new.items()}
    assert digests["w"] != trainer_digest(old["w"])


def test_digest_is_bitwise_and_layout_independent() -> None:
    t = torch.zeros(4, 6)
    negative = t.clone()
    negative[1, 2] = -0.0
    assert tensor_digest(t) != tensor_digest(negative)
    assert tensor_digest(t.t().contiguous().t()) == tensor_digest(t)
    assert tensor_digest(t.view(6, 4)) != tensor_digest(t)


@pytest.mark.parametrize(
    ("receiver_change", "error"),
    [
        (lambda r: r.pop("b"), GeometryMismatchError),
        (lambda r: r.update(b=torch.zeros(33)), GeometryMismatchError),
        (lambda r: r.update(b=torch.zeros(32, dtype=torch.float64)), GeometryMismatchError),
    ],
)
def test_geometry_mismatch_touches_nothing(
    receiver_change: Callable[[dict[str, torch.Tensor]], object], error: type[Exception]
) -> None:
    old, new = _pair()
    receiver = {name: t.clone() for name, t in old.items()}
    receiver_change(receiver)
    (payload,) = _payloads(old, new)
    with pytest.raises(error):
        apply_payload(payload, receiver, V0, undo=UndoLog())
    assert tensor_digest(receiver["w"]) == tensor_digest(old["w"])


def test_stale_receiver_is_told_which_version_it_needs() -> None:
    old, new = _pair()
    receiver = {name: t.clone() for name, t in old.items()}
    (payload,) = _payloads(old, new)
    with pytest.raises(StaleBaseError, match="needs base version 0"):
        apply_payload(payload, receiver, WeightVersion(9))
    assert _unchanged(receiver, old)


@pytest.mark.gpu
def test_apply_and_undo_on_a_cuda_receiver() -> None:
    old, new = _pair()
    receiver = {name: t.clone().cuda() for name, t in old.items()}
    undo = UndoLog()
    (payload,) = _payloads(old, new)
    applied = apply_payload(payload, receiver, V0, undo=undo)
    assert applied.digests() == {name: tensor_digest(t) for name, t in new.items()}
    undo.restore()
    assert {n: tensor_digest(t) for n, t in receiver.items()} == {
        n: tensor_digest(t) for n, t in old.items()
    }


def test_apply_writes_into_module_parameters() -> None:
    old, new = _pair()
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(old["w"].t().contiguous().t())
    module.b = torch.nn.Parameter(old["b"].clone())
    receiver = dict(module.named_parameters())
    undo = UndoLog()
    (payload,) = _payloads(old, new)
    applied = apply_payload(payload, receiver, V0, undo=undo)
    assert applied.digests() == {name: tensor_digest(t) for name, t in new.items()}
    assert all(p.requires_grad for p in module.parameters())
    undo.restore()
    assert _unchanged(receiver, old)
