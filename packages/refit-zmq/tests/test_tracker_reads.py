"""A producer reads only the bytes of the items it owns, and the device code path (torch ops,
run here on CPU tensors) encodes exactly what the host kernel does.

Reads are checked two ways: the tracker's own counter, and a dispatch mode that records every
element of the source tensors that any torch op reads (view ops excluded), so a whole-tensor
copy of a partly owned tensor (``.contiguous()``, ``.cpu()``) is caught independently of the
tracker's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_core import GeometryMismatchError, TensorSpec, WeightVersion
from refit_zmq.codec import DeltaPayload, Encoding, UndoLog, apply_payload
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig, shard_items

V0, V1, V2 = WeightVersion(0), WeightVersion(1), WeightVersion(2)
SHARDS = 4
ITEM_BYTES = 4096
MODES = ("auto", "device")
"""``auto`` compares these CPU tensors on the host; ``device`` with torch ops."""


def _laid_out(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous values in the layouts of a trainer's state: a transposed weight and a
    column slice of a wider buffer among them."""
    wide = torch.zeros(values["gate"].shape[0], values["gate"].shape[1] + 2, dtype=torch.bfloat16)
    wide[:, 1:-1] = values["gate"]
    return {
        **values,
        "proj_t": values["proj_t"].t().contiguous().t(),
        "gate": wide[:, 1:-1],
    }


def _values(seed: int) -> dict[str, torch.Tensor]:
    """Tensors larger than an item (so split among ranks), an odd-sized one that cannot be
    read as 64-bit words, and a small one."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(96, 64, generator=gen).to(torch.bfloat16),
        "proj_t": torch.randn(80, 64, generator=gen),
        "gate": torch.randn(40, 128, generator=gen).to(torch.bfloat16),
        "odd": torch.randn(3, 1001, generator=gen).to(torch.float16),
        "norm": torch.ones(64),
    }


def _state(seed: int) -> dict[str, torch.Tensor]:
    return _laid_out(_values(seed))


def _step(
    state: dict[str, torch.Tensor], seed: int, fraction: float = 0.01
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for name, tensor in state.items():
        changed = tensor.contiguous().clone()
        hit = torch.rand(tensor.shape, generator=gen) < fraction
        changed[hit] = (changed[hit].float() * 1.5 + 0.125).to(tensor.dtype)
        values[name] = changed
    return _laid_out(values)


def _spec(state: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(t) for name, t in state.items()}


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Row-major element -> the offsets of its bytes in the tensor's storage (one row each)."""
    size = tensor.element_size()
    storage = tensor.untyped_storage().nbytes() // size
    positions = torch.arange(storage).as_strided(
        tensor.shape, tensor.stride(), tensor.storage_offset()
    )
    return positions.reshape(-1, 1) * size + torch.arange(size)


class _ReadRecorder(TorchDispatchMode):
    """Records the storage bytes of the watched tensors that any non-view op reads, and the
    bytes copied from a GPU to the host, in this thread and (through :meth:`watch`) in a
    tracker's worker threads."""

    def __init__(self, watched: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._by_storage = {t.untyped_storage().data_ptr(): name for name, t in watched.items()}
        self.read: dict[str, set[int]] = {name: set() for name in watched}
        self.to_host_bytes = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if not func.is_view:
            for arg in inputs:
                name = self._by_storage.get(arg.untyped_storage().data_ptr())
                if name is not None:
                    self.read[name].update(_storage_bytes(arg).reshape(-1).tolist())
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and inputs[0].device.type != "cpu":
            self.to_host_bytes += out.nbytes if out.device.type == "cpu" else 0
        if func is torch.ops.aten.copy_.default and inputs[1].device.type != "cpu":
            self.to_host_bytes += inputs[0].nbytes if inputs[0].device.type == "cpu" else 0
        return out

    def watch(self, tracker: DeltaCompressionTracker, monkeypatch: pytest.MonkeyPatch) -> None:
        """Record in the tracker's worker threads too (dispatch modes are per thread)."""
        pool = tracker._pool
        submit = pool.submit

        def recorded(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            def run() -> Any:
                with self:
                    return fn(*args, **kwargs)

            return submit(run)

        monkeypatch.setattr(pool, "submit", recorded)


def _owned_positions(state: dict[str, torch.Tensor], rank: int) -> dict[str, set[int]]:
    owned: dict[str, set[int]] = {name: set() for name in state}
    items = shard_items(
        _spec(state), shard_rank=rank, shard_count=SHARDS, max_item_bytes=ITEM_BYTES
    )
    for item in items:
        offsets = _storage_bytes(state[item.name])
        owned[item.name].update(offsets[item.start : item.stop].reshape(-1).tolist())
    return owned


def _tracker(
    state: dict[str, torch.Tensor], rank: int, mode: str, baseline: str = "device"
) -> DeltaCompressionTracker:
    config = TrackerConfig(
        shard_rank=rank,
        shard_count=SHARDS,
        max_item_bytes=ITEM_BYTES,
        bucket_size_bytes=4 * ITEM_BYTES,
        threads=2,
        compare_on=mode,  # type: ignore[arg-type]
        device_baseline=baseline,  # type: ignore[arg-type]
    )
    return DeltaCompressionTracker(_spec(state), config)


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_reads_exactly_the_bytes_it_owns(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = _state(0), _step(_state(0), 1)
    total = sum(t.numel() * t.element_size() for t in old.values())
    read_by_ranks = 0
    for rank in range(SHARDS):
        with _tracker(old, rank, mode) as tracker:
            owned_bytes = sum(item.nbytes for item in tracker.items)
            tracker.load_baseline(old, V0)
            assert tracker.traffic.read_bytes == owned_bytes
            recorder = _ReadRecorder(new)
            recorder.watch(tracker, monkeypatch)
            with recorder:
                payloads = list(tracker.encode(new, V1))
            assert payloads
            tracker.commit()
            assert tracker.traffic.read_bytes == owned_bytes
            read_by_ranks += tracker.traffic.read_bytes
            owned = _owned_positions(new, rank)
            for name, positions in recorder.read.items():
                outside = positions - owned[name]
                assert not outside, (
                    f"rank {rank} read {len(outside)} bytes of {name} it does not own"
                )
                if mode == "device" or not new[name].is_contiguous():
                    assert positions == owned[name], f"rank {rank} skipped owned elements of {name}"
    assert read_by_ranks == total


def _carried_bytes(payloads: list[DeltaPayload]) -> int:
    """Values of every carried element, and an int32 index for each GAPS or BITMAP one."""
    located = (Encoding.GAPS, Encoding.BITMAP)
    return sum(
        item.count * (item.itemsize + 4 * (item.encoding in located))
        for payload in payloads
        for item in payload.items
    )


def test_the_device_path_hands_the_host_only_changed_elements() -> None:
    old = _state(0)
    new = _step(old, 1)
    with _tracker(old, 0, "device") as tracker:
        tracker.load_baseline(old, V0)
        payloads = list(tracker.encode(new, V1))
        assert sum(p.changed_elements for p in payloads) > 0
        assert tracker.traffic.to_host_bytes <= _carried_bytes(payloads)
        assert tracker.traffic.to_host_bytes < tracker.traffic.read_bytes / 10


def _refit_sequence(
    mode: str,
    rank: int,
    steps: Callable[[], list[dict[str, torch.Tensor]]],
    baseline: str = "device",
) -> list[bytes]:
    """Payload bytes of: a first (dense) refit, two deltas, an aborted delta, a resync."""
    states = steps()
    out: list[bytes] = []
    with _tracker(states[0], rank, mode, baseline) as tracker:
        for version, state in enumerate(states[:3]):
            out += [p.to_bytes() for p in tracker.encode(state, WeightVersion(version))]
            tracker.commit()
        out += [p.to_bytes() for p in tracker.encode(states[3], WeightVersion(3))]
        tracker.abort()
        out += [p.to_bytes() for p in tracker.encode(states[3], WeightVersion(3), resync=True)]
        tracker.commit()
        out += [p.to_bytes() for p in tracker.encode(states[4], WeightVersion(4))]
        tracker.commit()
    return out


def _states() -> list[dict[str, torch.Tensor]]:
    states = [_state(0)]
    for seed, fraction in ((1, 0.01), (2, 0.3), (3, 0.001), (4, 0.02)):
        states.append(_step(states[-1], seed, fraction))
    return states


@pytest.mark.parametrize("rank", range(SHARDS))
def test_device_path_encodes_the_same_bytes_as_the_host_kernel(rank: int) -> None:
    assert _refit_sequence("device", rank, _states) == _refit_sequence("host", rank, _states)


def test_device_path_refits_a_receiver_bit_exactly_and_pinned_baselines_alike() -> None:
    states = _states()
    for baseline in ("device", "pinned"):
        receiver = {name: torch.zeros_like(t) for name, t in states[0].items()}
        held: WeightVersion | None = None
        spec = _spec(states[0])
        config = TrackerConfig(threads=2, compare_on="device", device_baseline=baseline)  # type: ignore[arg-type]
        with DeltaCompressionTracker(spec, config) as tracker:
            for version, state in enumerate(states):
                undo = UndoLog()
                for payload in tracker.encode(state, WeightVersion(version)):
                    apply_payload(payload, receiver, held, undo=undo)
                held = tracker.commit()
                undo.discard()
                for name, tensor in state.items():
                    held_bits = receiver[name].contiguous().view(torch.uint8)
                    assert torch.equal(held_bits, tensor.contiguous().view(torch.uint8))
            assert tracker.baseline_bytes == sum(
                t.numel() * t.element_size() for t in states[0].values()
            )


def test_a_tensor_that_moves_device_is_refused_until_a_new_tracker() -> None:
    old = {"w": torch.zeros(64)}
    with DeltaCompressionTracker(_spec(old), TrackerConfig(compare_on="device")) as tracker:
        tracker.load_baseline(old, V0)
        meta = {"w": torch.zeros(64, device="meta")}
        with pytest.raises(GeometryMismatchError, match="moved from cpu to meta"):
            list(tracker.encode(meta, V1))
        assert tracker.pending is None


def _on_gpu(states: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{name: t.to("cuda") for name, t in state.items()} for state in states]


@pytest.mark.gpu
@pytest.mark.parametrize("baseline", ["device", "pinned"])
def test_gpu_tensors_encode_on_the_gpu_to_the_host_kernels_bytes(baseline: str) -> None:
    def on_gpu(mode: str, rank: int) -> list[bytes]:
        return _refit_sequence(mode, rank, lambda: _on_gpu(_states()), baseline=baseline)

    for rank in range(SHARDS):
        assert on_gpu("auto", rank) == _refit_sequence("host", rank, _states)
        assert on_gpu("host", rank) == _refit_sequence("host", rank, _states)


@pytest.mark.gpu
@pytest.mark.parametrize("baseline", ["device", "pinned"])
def test_only_changed_elements_cross_from_the_gpu(
    baseline: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = _on_gpu([_state(0), _step(_state(0), 1)])
    for rank in range(SHARDS):
        with _tracker(old, rank, "auto", baseline=baseline) as tracker:
            tracker.load_baseline(old, V0)
            recorder = _ReadRecorder(new)
            recorder.watch(tracker, monkeypatch)
            with recorder:
                payloads = list(tracker.encode(new, V1))
            traffic = tracker.traffic
            owned = _owned_positions(new, rank)
            for name, positions in recorder.read.items():
                assert positions == owned[name]
            assert traffic.read_bytes == sum(item.nbytes for item in tracker.items)
            assert recorder.to_host_bytes == traffic.to_host_bytes
            assert traffic.to_host_bytes <= _carried_bytes(payloads)
            assert traffic.to_host_bytes < traffic.read_bytes / 10
            tracker.commit()
