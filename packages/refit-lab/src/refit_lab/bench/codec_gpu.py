"""Bench `codec --device cuda`: the GPU delta encoder at 1 % changed against its references.

`refit bench codec --device cuda [--bytes N] [--quick]` (default 8 GiB, quick 1 GiB; at least
N bytes of Llama-shaped bf16, simulated on the GPU: :mod:`refit_lab.bench.deltas`). In every
round, interleaved on the same tensors:

- ``d2d_copy``: one device-to-device copy of the same bytes (the reference of the ratio the
  issue sets: GPU encode >= 0.5x of it);
- ``refit_gpu``: the tracker's encode with its baseline on the GPU (compare, index extraction
  and gather there; only changed indices and values cross), checksum and coding included;
- ``refit_gpu_pinned``: the same with the baseline in pinned host memory (each item's
  baseline is copied to the GPU before its compare);
- ``refit_gpu_diff``: the GPU encoder's change detection alone (``codec.device_diff``: word
  compare, indices, gather, the changes copied to the host) per item of 64 MiB, no coding;
- ``torch_ne_nonzero``: torch's own ``ne`` and ``nonzero`` per tensor, the gather of the new
  values and both copied to the host (the straightforward GPU delta, without coding);
- ``refit_host``: the tracker's host path (owned spans copied to pinned host memory, then the
  compiled host kernel and the same coding);
- ``refit_gpu_apply``: the receiver's side: ``refit_gpu``'s payloads applied in place to a copy
  of the old state on the GPU (the copy is restored from the old state before each round,
  outside the timing).

Ratios are medians of per-round ratios; each reference's median rate is recorded beside its
ratio. The GPU encoders' payloads must equal the host path's byte for byte, and applying them
to a copy of the old state on the GPU must give the new bits exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from refit_core import TensorSpec, WeightVersion
from refit_lab.bench.deltas import (
    ModelShape,
    State,
    calibrate_lr,
    same_bits,
    simulate_adamw,
    state_bytes,
)
from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    machine_info,
    rate_fields,
)
from refit_lab.bench.references import Memcpy
from refit_zmq.codec import DeltaPayload, apply_payload, fetch_diff
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

__all__ = ["FULL_BYTES", "QUICK_BYTES", "measure_gpu"]

logger = logging.getLogger(__name__)

FULL_BYTES = 8 << 30
QUICK_BYTES = 1 << 30
FRACTION = 0.01
REPEATS = 3
ITEM_ELEMENTS = (64 << 20) // 2
"""bf16 elements of one item (the tracker's default ``max_item_bytes``)."""
ENCODERS = {
    "refit_gpu": {"compare_on": "device", "device_baseline": "device"},
    "refit_gpu_pinned": {"compare_on": "device", "device_baseline": "pinned"},
    "refit_host": {"compare_on": "host", "device_baseline": "device"},
}
"""Tracker settings of each encoder (``device`` is what ``auto`` picks for GPU tensors)."""


def _timed(fn: Callable[[], object], device: str) -> float:
    """Seconds of ``fn``, up to the completion of its GPU work."""

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)

    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def _refit_gpu_diff(old: State, new: State) -> None:
    """refit's device change detection over every item, changes fetched, nothing coded."""
    for name, tensor in new.items():
        bits, base = tensor.view(torch.int16).reshape(-1), old[name].view(torch.int16).reshape(-1)
        for start in range(0, bits.numel(), ITEM_ELEMENTS):
            stop = start + ITEM_ELEMENTS
            fetch_diff(base[start:stop], bits[start:stop])


def _torch_ne_nonzero(old: State, new: State) -> None:
    """The straightforward GPU delta: changed positions and values of every tensor, to host."""
    for name, tensor in new.items():
        bits, base = tensor.view(torch.int16).reshape(-1), old[name].view(torch.int16).reshape(-1)
        index = torch.nonzero(bits != base).view(-1)
        index.cpu()
        bits[index].cpu()


class _Encoder:
    """A tracker loaded with the old state; each call encodes the new one and aborts."""

    def __init__(self, old: State, new: State, threads: int, **config: str) -> None:
        specs = {name: TensorSpec.of(t) for name, t in old.items()}
        self._new = new
        self.tracker = DeltaCompressionTracker(
            specs,
            TrackerConfig(threads=threads, **config),  # type: ignore[arg-type]
        )
        self.tracker.load_baseline(old, WeightVersion(0))
        self.payloads: list[DeltaPayload] = []

    def __call__(self) -> None:
        self.payloads = list(self.tracker.encode(self._new, WeightVersion(1)))
        self.tracker.abort()


class _Applier:
    """The receiver's apply of an encoder's latest payloads onto a copy of the old state."""

    def __init__(self, old: State, encoder: _Encoder) -> None:
        self._old = old
        self._encoder = encoder
        self.receiver = {name: t.clone() for name, t in old.items()}

    def restore(self) -> None:
        """Put the old state back into the receiver (untimed, before each apply)."""
        for name, tensor in self.receiver.items():
            tensor.copy_(self._old[name])

    def __call__(self) -> None:
        for payload in self._encoder.payloads:
            apply_payload(payload.frames, self.receiver, WeightVersion(0))


def _bitexact(old: State, new: State, payloads: list[DeltaPayload]) -> bool:
    receiver = {name: t.clone() for name, t in old.items()}
    for payload in payloads:
        apply_payload(payload.frames, receiver, WeightVersion(0))
    exact = same_bits(receiver, new)
    del receiver
    return exact


def measure_gpu(
    ctx: BenchContext, *, repeats: int = REPEATS, seed: int = 0, device: str = "cuda"
) -> BenchReport:
    """Run the GPU cases on a state of ``ctx.size_bytes`` (default by ``ctx.quick``).

    ``device`` is for the CPU tests of this bench's logic; the command always uses cuda.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("refit bench codec --device cuda needs a CUDA GPU")
    size = ctx.size_bytes or (QUICK_BYTES if ctx.quick else FULL_BYTES)
    model = ModelShape.of_bytes(size)
    ctx.progress(f"simulating AdamW on the GPU ({model.nbytes} bytes)", 0.0)
    trajectory = simulate_adamw(model, seed=seed, device=device)
    old = trajectory.bf16(0.0)
    new = trajectory.bf16(calibrate_lr(trajectory, FRACTION))
    del trajectory
    dense = state_bytes(old)
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    ctx.progress("loading baselines", 0.2)
    copy = Memcpy(dense, threads=ctx.threads, device=device)
    encoders = {
        name: _Encoder(old, new, ctx.threads, **config) for name, config in ENCODERS.items()
    }
    applier = _Applier(old, encoders["refit_gpu"])
    cases: dict[str, Callable[[], object]] = {
        "d2d_copy": copy.seconds,
        **encoders,
        "refit_gpu_apply": applier,
        "refit_gpu_diff": lambda: _refit_gpu_diff(old, new),
        "torch_ne_nonzero": lambda: _torch_ne_nonzero(old, new),
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(repeats + 1):
        ctx.progress(f"round {round_index} of {repeats}", 0.3 + 0.6 * round_index / (repeats + 1))
        applier.restore()
        for name, case in cases.items():
            elapsed = _timed(case, device)
            if round_index:
                seconds[name].append(elapsed)
    ctx.progress("checking the payloads", 0.9)
    reference = [p.to_bytes() for p in encoders["refit_host"].payloads]
    same = all(
        [p.to_bytes() for p in encoders[name].payloads] == reference
        for name in ("refit_gpu", "refit_gpu_pinned")
    )
    exact = (
        same
        and _bitexact(old, new, encoders["refit_gpu"].payloads)
        and same_bits(applier.receiver, new)
    )
    del applier
    to_host = encoders["refit_gpu"].tracker.traffic.to_host_bytes
    for encoder in encoders.values():
        encoder.tracker.close()

    def paired(subject: str, reference: str) -> PairedRatio:
        return PairedRatio.of(
            subject_s=seconds[subject], reference_s=seconds[reference], nbytes=dense
        )

    rows: list[dict[str, object]] = []
    for name in seconds:
        vs_copy = paired(name, "d2d_copy")
        rows.append(
            {
                "case": name,
                "nbytes": dense,
                **rate_fields("gbps", vs_copy.subject_rounds_gbps),
                "vs_d2d_copy": vs_copy.ratio,
            }
        )
    summary: dict[str, float | bool] = {
        **paired("refit_gpu", "d2d_copy").summary("gpu_encode_fraction_of_d2d_copy"),
        **paired("refit_gpu", "torch_ne_nonzero").summary("gpu_encode_speedup_vs_torch_ne_nonzero"),
        **paired("refit_gpu_diff", "d2d_copy").summary("gpu_diff_fraction_of_d2d_copy"),
        **paired("refit_gpu_diff", "torch_ne_nonzero").summary(
            "gpu_diff_speedup_vs_torch_ne_nonzero"
        ),
        **paired("refit_gpu", "refit_host").summary("gpu_encode_speedup_vs_host_path"),
        **paired("refit_gpu_pinned", "d2d_copy").summary("pinned_encode_fraction_of_d2d_copy"),
        **paired("refit_gpu_apply", "d2d_copy").summary("gpu_apply_fraction_of_d2d_copy"),
        "gpu_encode_gbps": paired("refit_gpu", "d2d_copy").subject_gbps,
        "gpu_apply_gbps": paired("refit_gpu_apply", "d2d_copy").subject_gbps,
        "to_host_fraction": to_host / dense,
        "changed_fraction": changed / (dense // 2),
        "state_bytes": dense,
        "bitexact": exact,
    }
    ctx.progress("codec (GPU) done", 1.0)
    return BenchReport(
        bench="codec", quick=ctx.quick, machine=machine_info(), results=rows, summary=summary
    )
