"""Bench `sglang`: flattened buckets against one handle per tensor, through the same path.

About 1000 tensors (alternating bf16 and fp32; 8 MiB quick, 128 MiB full) are refit into an
in-process Engine-like receiver by refit-sglang's colocated synchronizer twice: once with
buckets of 64 MiB (a handful of flattened shared-memory buffers and calls), once with a bucket
size of one byte (every tensor alone: one buffer, one handle and one
``update_weights_from_tensor`` call per tensor). Both cases make the same calls with the same
hops (pause, updates, flush, continue; the receiver unpickles each payload, maps the buffer
and copies every tensor into its own weights, as SGLang does). memcpy of the same bytes, and
both cases, run once per round, interleaved; ratios are medians of per-round ratios, with
the reference's rate beside them. ``bitexact`` checks every receiver's weights at the end.
"""

from __future__ import annotations

import base64
import logging
import pickle
import statistics
from types import SimpleNamespace
from typing import Any

import torch

from refit_core.sources import StateDictSource
from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    gbps,
    machine_info,
    rate_fields,
    timeit,
)
from refit_lab.bench.references import Memcpy
from refit_lab.bench.runtime import torch_threads

logger = logging.getLogger(__name__)

TENSORS = 1000
QUICK_ELEMENTS = 2048
FULL_ELEMENTS = 32768
BUCKET_BYTES = 64 * 1024**2
CASES = {"flattened": BUCKET_BYTES, "per_tensor": 1}


def bench_state(elements: int) -> dict[str, torch.Tensor]:
    """``TENSORS`` tensors of about ``elements`` elements, alternating bf16 and fp32."""
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(elements + i % 7, generator=gen).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(TENSORS)
    }


class _Policy:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self._state)


class _Receiver:
    """``sglang.Engine``'s refit surface doing what SGLang does with a flattened bucket."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.weights = {name: torch.zeros_like(t) for name, t in state.items()}
        self.server_args = SimpleNamespace(tp_size=1)

    def pause_generation(self, mode: str) -> tuple[bool, str]:
        return True, "paused"

    def continue_generation(self) -> tuple[bool, str]:
        return True, "continued"

    def flush_cache(self) -> tuple[bool, str]:
        return True, "flushed"

    def update_weights_from_tensor(
        self, named_tensors: list[str], load_format: str, flush_cache: bool, **_: object
    ) -> tuple[bool, str]:
        for payload in named_tensors:
            bucket = pickle.loads(base64.b64decode(payload))
            flat = bucket["flattened_tensor"]
            for meta in bucket["metadata"]:
                self.weights[meta.name].copy_(flat[meta.start_idx : meta.end_idx].view(meta.shape))
        return True, "loaded"

    def matches(self, state: dict[str, torch.Tensor]) -> bool:
        return all(
            torch.equal(self.weights[n].view(torch.uint8), t.view(torch.uint8))
            for n, t in state.items()
        )


def _synchronizer(state: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[Any, _Receiver]:
    """refit-sglang's colocated synchronizer into its own receiver."""
    from refit_sglang import ColocatedOptions, ColocatedSGLangSynchronizer, EngineClient

    receiver = _Receiver(state)
    synchronizer = ColocatedSGLangSynchronizer(
        _Policy(state),
        [EngineClient(receiver)],
        options=ColocatedOptions(bucket_size_bytes=bucket_bytes),
    )
    return synchronizer, receiver


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: about 8 MiB in 1000 tensors when quick, 128 MiB otherwise.

    Every round runs memcpy, then each case once (interleaved), after one warm-up round.
    """
    state = bench_state(QUICK_ELEMENTS if ctx.quick else FULL_ELEMENTS)
    total = sum(t.numel() * t.element_size() for t in state.values())
    repeats = 5 if ctx.quick else 3
    memcpy = Memcpy(total, threads=ctx.threads)
    seconds: dict[str, list[float]] = {"memcpy": [], **{case: [] for case in CASES}}
    built = {case: _synchronizer(state, bucket_bytes) for case, bucket_bytes in CASES.items()}
    try:
        with torch_threads(ctx.threads):
            for index in range(repeats + 1):
                ctx.progress(f"round {index} of {repeats}", index / (repeats + 1))
                took = {"memcpy": memcpy.seconds()}
                for case, (synchronizer, _) in built.items():
                    took[case] = timeit(synchronizer.sync_weights, repeats=1, warmup=0).min_s
                for case, elapsed in took.items():
                    if index:
                        seconds[case].append(elapsed)
    finally:
        for synchronizer, _ in built.values():
            synchronizer.shutdown()
    exact = {case: receiver.matches(state) for case, (_, receiver) in built.items()}
    memcpy_rates = [gbps(total, s) for s in seconds["memcpy"]]
    results: list[dict[str, object]] = [
        {"case": "memcpy", "nbytes": total, **rate_fields("gbps", memcpy_rates)}
    ]
    for case in CASES:
        vs_memcpy = PairedRatio.of(
            subject_s=seconds[case], reference_s=seconds["memcpy"], nbytes=total
        )
        results.append(
            {
                "case": case,
                "tensors": len(state),
                "nbytes": total,
                "seconds": statistics.median(seconds[case]),
                **rate_fields("gbps", vs_memcpy.subject_rounds_gbps),
                "vs_memcpy": vs_memcpy.ratio,
                "bitexact": exact[case],
            }
        )
    speedup = PairedRatio.of(
        subject_s=seconds["flattened"], reference_s=seconds["per_tensor"], nbytes=total
    )
    ctx.progress("sglang done", 1.0)
    return BenchReport(
        bench="sglang",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary={
            **speedup.summary("bucket_speedup_vs_per_tensor"),
            "bitexact": all(exact.values()),
        },
    )
