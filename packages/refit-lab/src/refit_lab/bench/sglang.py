"""Bench `sglang`: flattened buckets against one handle per tensor, through the same path.

About 1000 tensors (alternating bf16 and fp32; 8 MiB quick, 128 MiB full) are refit into an
in-process Engine-like receiver by refit-sglang's colocated synchronizer twice: once with
buckets of 64 MiB (a handful of flattened shared-memory buffers and calls), once with a bucket
size of one byte (every tensor alone: one buffer, one handle and one
``update_weights_from_tensor`` call per tensor). Both cases make the same calls with the same
hops (pause, updates, flush, continue; the receiver unpickles each payload, maps the buffer
and copies every tensor into its own weights, as SGLang does). memcpy of the same bytes is the
reference. ``bitexact`` checks the receiver's weights after every case.
"""

from __future__ import annotations

import base64
import logging
import pickle
from types import SimpleNamespace

import torch

from refit_core.sources import StateDictSource
from refit_lab.bench.harness import BenchContext, BenchReport, gbps, machine_info, timeit
from refit_lab.bench.references import memcpy_gbps
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


def _case(state: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> tuple[float, bool]:
    """Median seconds of one refit, and whether the receiver ends bit-exact."""
    from refit_sglang import ColocatedOptions, ColocatedSGLangSynchronizer, EngineClient

    receiver = _Receiver(state)
    synchronizer = ColocatedSGLangSynchronizer(
        _Policy(state),
        [EngineClient(receiver)],
        options=ColocatedOptions(bucket_size_bytes=bucket_bytes),
    )
    try:
        stats = timeit(synchronizer.sync_weights, repeats=repeats, warmup=1)
    finally:
        synchronizer.shutdown()
    return stats.median_s, receiver.matches(state)


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: about 8 MiB in 1000 tensors when quick, 128 MiB otherwise."""
    state = bench_state(QUICK_ELEMENTS if ctx.quick else FULL_ELEMENTS)
    total = sum(t.numel() * t.element_size() for t in state.values())
    repeats = 5 if ctx.quick else 3
    ctx.progress(f"memcpy {total} bytes", 0.0)
    results: list[dict[str, object]] = [
        {
            "case": "memcpy",
            "nbytes": total,
            "gbps": memcpy_gbps(total, repeats=repeats, threads=ctx.threads),
        }
    ]
    seconds: dict[str, float] = {}
    exact = True
    with torch_threads(ctx.threads):
        for index, (case, bucket_bytes) in enumerate(CASES.items()):
            ctx.progress(f"{case}: {len(state)} tensors", (index + 1) / (len(CASES) + 1))
            seconds[case], ok = _case(state, bucket_bytes, repeats)
            exact = exact and ok
            results.append(
                {
                    "case": case,
                    "tensors": len(state),
                    "nbytes": total,
                    "seconds": seconds[case],
                    "gbps": gbps(total, seconds[case]),
                    "bitexact": ok,
                }
            )
    ctx.progress("sglang done", 1.0)
    return BenchReport(
        bench="sglang",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary={
            "bucket_speedup_vs_per_tensor": seconds["per_tensor"] / seconds["flattened"],
            "bitexact": exact,
        },
    )
