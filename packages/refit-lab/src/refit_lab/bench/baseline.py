"""Bench `baseline`: the three references alone, so every other bench has numbers to beat."""

from __future__ import annotations

from refit_lab.bench.harness import BenchContext, BenchReport, machine_info
from refit_lab.bench.references import MiB, gloo_broadcast_gbps, memcpy_gbps, zmq_stream

QUICK_BYTES = 64 * MiB
FULL_BYTES = 512 * MiB
REPEATS = 5


def measure(ctx: BenchContext, *, nbytes: int, repeats: int = REPEATS) -> BenchReport:
    """Measure memcpy, gloo broadcast and zmq stream of `nbytes`, `repeats` times each."""
    ctx.progress(f"memcpy {nbytes} bytes", 0.0)
    memcpy = memcpy_gbps(nbytes, repeats=repeats, threads=ctx.threads)
    ctx.progress(f"gloo broadcast {nbytes} bytes", 1 / 3)
    gloo = gloo_broadcast_gbps(nbytes, repeats=repeats, threads=ctx.threads)
    ctx.progress(f"zmq stream {nbytes} bytes", 2 / 3)
    zmq = zmq_stream(nbytes, repeats=repeats).gbps
    ctx.progress("baseline done", 1.0)
    rates = {"memcpy": memcpy, "gloo_broadcast": gloo, "zmq_stream": zmq}
    return BenchReport(
        bench="baseline",
        quick=ctx.quick,
        machine=machine_info(),
        results=[
            {
                "case": case,
                "nbytes": nbytes,
                "threads": ctx.threads,
                "repeats": repeats,
                "gbps": rate,
                "vs_memcpy": rate / memcpy,
            }
            for case, rate in rates.items()
        ],
        summary={f"{case}_gbps": rate for case, rate in rates.items()},
    )


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: 64 MiB when quick, 512 MiB otherwise."""
    return measure(ctx, nbytes=QUICK_BYTES if ctx.quick else FULL_BYTES)
