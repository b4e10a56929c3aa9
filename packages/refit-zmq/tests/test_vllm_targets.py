"""The pieces of the sparse vLLM receiver that run without vLLM: the write map recorded from a
loader that slices, fuses and pads as vLLM's do (one tensor-parallel rank of two), the placement
of every checkpoint tensor, real delta payloads staged by the relay receiver and written in
place with undo, and the receiver's transactions.

vLLM's own loaders are exercised by ``tests/engine/test_write_map.py`` (engine tier)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest
import torch
from torch import nn

from refit_core import ProtocolError, RefitError, StaleBaseError, TensorSpec, WeightVersion
from refit_core.vllm.write_map import WriteMap, record_writes
from refit_zmq.relay import StaleTransferError, TransferConflictError
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig
from refit_zmq.vllm.delta_receiver import StagedDeltas
from refit_zmq.vllm.targets import CheckpointTargets, plan_targets

SHAPES = {
    "attn.q": (8, 8),
    "attn.k": (4, 8),
    "attn.o": (8, 8),
    "embed": (10, 8),
    "norm": (8,),
    "scaled": (4,),
}


class _Holder(nn.Module):
    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=torch.bfloat16)))


class _Rank1Of2(nn.Module):
    """Rank 1 of 2 of a model whose loader fuses q and k (rows), splits o by columns, pads the
    vocabulary from 10 to 12 rows, and scales one tensor (which no map can replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Holder(qk=(6, 8), o=(8, 4))
        self.embed = _Holder(weight=(6, 8))
        self.norm = _Holder(weight=(8,))
        self.scaled = _Holder(weight=(4,))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "attn.q":
                self.attn.qk.data.narrow(0, 0, 4).copy_(w.narrow(0, 4, 4))
            elif name == "attn.k":
                self.attn.qk.data.narrow(0, 4, 2).copy_(w.narrow(0, 2, 2))
            elif name == "attn.o":
                self.attn.o.data.copy_(w.narrow(1, 4, 4))
            elif name == "embed":
                self.embed.weight.data[:4].copy_(w.narrow(0, 6, 4))
                self.embed.weight.data[4:].fill_(0)
            elif name == "norm":
                self.norm.weight.data.copy_(w)
            elif name == "scaled":
                self.scaled.weight.data.copy_(w * 2)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def _stepped(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 10 % of the elements moved, as an optimizer step would."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.where(torch.rand(t.shape, generator=g) < 0.1, t + 0.5, t) for n, t in state.items()
    }


def _loaded(state: dict[str, torch.Tensor]) -> _Rank1Of2:
    model = _Rank1Of2()
    model.load_weights(state.items())
    return model


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().view(torch.int16).clone() for n, p in model.named_parameters()}


def _record(model: _Rank1Of2, state: dict[str, torch.Tensor]) -> WriteMap:
    return record_writes(dict(model.named_parameters()), state, model.load_weights)


def test_the_write_map_records_boxes_fills_and_writes_it_cannot_replay() -> None:
    state = _state(0)
    model = _loaded(state)
    before = _bits(model)
    found = _record(model, _state(1))
    assert _bits(model).keys() == before.keys()
    assert all(torch.equal(_bits(model)[n], b) for n, b in before.items()), "nothing written"
    q, k, o = found.pieces["attn.q"][0], found.pieces["attn.k"][0], found.pieces["attn.o"][0]
    assert (q.param, q.src.start, q.src.length, q.dst.start) == ("attn.qk", (4, 0), (4, 8), (0, 0))
    assert (k.param, k.src.start, k.dst.start) == ("attn.qk", (2, 0), (4, 0))
    assert (o.src.start, o.src.length) == ((0, 4), (8, 4))
    assert q.flat_range() == (32, 0) and o.flat_range() is None, "o's columns are not a run"
    assert [(f.dst.start, f.dst.length) for f in found.fills["embed.weight"]] == [((4, 0), (2, 8))]
    assert set(found.irregular) == {"scaled.weight"}
    for param, tensor in model.named_parameters():
        if param != "scaled.weight":
            assert found.uncovered(param, tuple(tensor.shape)) is None, param
    assert found.verify(state.items(), dict(model.named_parameters())) == {}
    model.norm.weight.data[3] += 1
    assert "norm.weight" in found.verify(state.items(), dict(model.named_parameters()))


def _targets(model: _Rank1Of2, state: dict[str, torch.Tensor]) -> CheckpointTargets:
    specs = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    plan = plan_targets(model, _record(model, state), specs, lambda: iter(state.items()))
    assert plan.shadowed == {"scaled"} and plan.reasons.keys() == {"scaled"}
    return CheckpointTargets(model, plan, {"scaled": state["scaled"].clone()})


def _send(deltas: StagedDeltas, payloads: Iterator[object], transfer_id: str) -> int:
    bodies = _bodies(payloads)
    for body in bodies:
        deltas.apply(body, {"transfer_id": transfer_id})
    return len(bodies)


def test_deltas_staged_then_written_in_place_equal_a_fresh_load() -> None:
    start = _state(0)
    first = _stepped(start, 1)
    second = _stepped(first, 2)
    model = _loaded(start)
    targets = _targets(model, start)
    deltas = StagedDeltas(
        targets, {n: (tuple(t.shape), t.dtype) for n, t in start.items()}, version=0
    )
    tracker = DeltaCompressionTracker(
        {n: TensorSpec.of(t) for n, t in start.items()},
        TrackerConfig(bucket_size_bytes=96, max_item_bytes=48),
    )
    assert _send(deltas, tracker.encode(first, WeightVersion(1)), "t1") > 3
    assert _equal(model, _loaded(start)), "staging writes nothing"
    opened = deltas.status().open
    assert opened is not None and opened.payloads > 3
    deltas.commit("t1")
    tracker.commit()
    version, writes = deltas.take_committed()
    targets.apply(writes).discard()
    assert version == 1
    assert _equal(model, _loaded(first)), "a dense resync, written in place"
    assert torch.equal(targets.shadow["scaled"], first["scaled"]), "and into the shadow"

    _send(deltas, tracker.encode(second, WeightVersion(2)), "t2")
    deltas.rollback("t2")
    tracker.abort()
    assert deltas.take_committed() == (1, [])
    assert _equal(model, _loaded(first)), "a rolled-back transfer never reaches the model"

    _send(deltas, tracker.encode(second, WeightVersion(2)), "t3")
    deltas.commit("t3")
    tracker.commit()
    writes = deltas.take_committed()[1]
    held = [w for w in writes if w.positions is not None]
    assert held and all(w.positions.dtype == torch.int32 for w in held if w.positions is not None)
    assert sum(w.nbytes for w in held) == 6 * sum(w.values.numel() for w in held), (
        "a changed bf16 element waits as its 2 bytes and a 4-byte position"
    )
    undo = targets.apply(writes)
    assert _equal(model, _loaded(second)), "a sparse delta, written in place"
    assert torch.equal(targets.shadow["scaled"], second["scaled"])
    undo.restore()
    assert _equal(model, _loaded(first)), "and undone, bit for bit"
    assert torch.equal(targets.checkpoint_tensor("norm"), first["norm"])
    with pytest.raises(RefitError, match="holds 32 of 64 elements"):
        targets.checkpoint_tensor("attn.q")


def _equal(model: nn.Module, other: nn.Module) -> bool:
    mine, theirs = _bits(model), _bits(other)
    return all(torch.equal(mine[n], theirs[n]) for n in mine if not n.startswith("scaled"))


def _bodies(payloads: Iterable[object]) -> list[memoryview]:
    return [
        memoryview(b"".join(bytes(memoryview(f).cast("B")) for f in p.frames))  # type: ignore[attr-defined]
        for p in payloads
    ]


def test_the_receiver_refuses_what_does_not_follow_and_keeps_one_transfer_open() -> None:
    start = _state(0)
    targets = _targets(_loaded(start), start)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in start.items()}
    deltas = StagedDeltas(targets, specs, version=3)
    tracker = DeltaCompressionTracker({n: TensorSpec.of(t) for n, t in start.items()})
    (stale,) = _bodies(tracker.encode(_stepped(start, 1), WeightVersion(2)))
    with pytest.raises(StaleTransferError):
        deltas.apply(stale, {"transfer_id": "old"})
    tracker.abort()
    tracker.load_baseline(start, WeightVersion(3))
    (payload,) = _bodies(tracker.encode(_stepped(start, 1), WeightVersion(4)))
    with pytest.raises(ProtocolError, match="its BEGIN from 3 to 5"):
        deltas.apply(payload, {"transfer_id": "a", "base": 3, "target": 5})
    assert deltas.status().open is None, "a refused payload stages nothing"
    deltas.apply(payload, {"transfer_id": "a", "base": 3, "target": 4})
    with pytest.raises(TransferConflictError):
        deltas.apply(payload, {"transfer_id": "b"})
    with pytest.raises(ProtocolError, match="digests"):
        deltas.status(digests=True)
    assert deltas.commit("a").committed
    assert not deltas.commit("a").committed, "a repeated commit is answered, not redone"
    with pytest.raises(StaleTransferError):
        deltas.rollback("a")
    tracker.commit()
    (next_payload,) = _bodies(tracker.encode(_stepped(start, 2), WeightVersion(5)))
    deltas.restore_version(3)  # the engine could not take 4: it stayed on 3
    with pytest.raises(StaleBaseError):
        deltas.apply(next_payload, {"transfer_id": "c"})


class _Shared(nn.Module):
    """``x`` is copied into two modules; ``b`` is also written with a computed value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _Holder(w=(4,))
        self.b = _Holder(w=(4,), v=(4,))
        self.c = _Holder(w=(4,))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "x":
                self.a.w.data.copy_(w)
                self.b.w.data.copy_(w)
            elif name == "y":
                self.b.v.data.copy_(w * 2)
            else:
                self.c.w.data.copy_(w)


def test_a_shadowed_module_takes_every_tensor_and_module_it_is_reloaded_with() -> None:
    state = {n: torch.ones(4, dtype=torch.bfloat16) for n in ("x", "y", "z")}
    model = _Shared()
    model.load_weights(state.items())
    found = record_writes(dict(model.named_parameters()), state, model.load_weights)
    specs = {n: ((4,), torch.bfloat16) for n in state}
    plan = plan_targets(model, found, specs, lambda: iter(state.items()))
    assert plan.groups == {"x": {"x", "y"}, "y": {"x", "y"}}, "x reloads b with y, and a"
    assert plan.reload_set(["y"]) == {"x", "y"}
    assert set(plan.pieces) == {"z"}
