"""Bench `ipc`: the colocated IPC channel against memcpy of the same bytes, same run.

A synthetic bf16 state (quick 64 MiB, full 512 MiB, reference-model shaped) is refit through
refit-zmq's :class:`~refit_zmq.ipc.IpcWeightSynchronizer` (two shared-memory ping-pong buffers
on CPU) into the real parameters of a reference engine in a child process, whose
:class:`~refit_zmq.ipc.IpcReceiver` is driven by ``serve_refit`` in the child's main thread,
as a vLLM worker drives it. Each round times one memcpy of the same bytes (the harness
reference) and one refit, side by side; between rounds every tensor of the state is negated,
so each refit carries other bits, and the engine's final weights are compared bit for bit
with the trainer's final state. ``ipc_fraction_of_memcpy`` is the median of the per-round
ratios of IPC rate to memcpy rate; ``ipc_fraction_of_memcpy_reference_gbps`` is memcpy's own
median rate.

The ceiling, timed in every round too: the channel must copy every byte twice (into shared
memory, then into the engine's parameters, which the engine protocol takes as tensors), and
:class:`~refit_lab.bench.copy_pipeline.CopyPipeline` does exactly that work and nothing else
(same buffers, slots and threads, a pipe instead of the control protocol, into another
reference engine's parameters). ``ceiling_fraction_of_memcpy`` is what it reaches,
``ipc_fraction_of_ceiling`` how close the channel gets to it. Every row keeps its per-round
seconds (``round_s``), from which :func:`summarize` computes every ratio.

Threads: memcpy runs with ``--threads``; the IPC path copies twice at once (the trainer fills
one buffer while the engine loads the other), so each of its two processes gets half of them
(at least one), the same total. Giving each side all of them oversubscribes the cores (on 2
cores: 0.07 of memcpy instead of 0.44, OpenMP threads spinning against each other).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refit_core.sources import StateDictSource
from refit_lab.bench.copy_pipeline import CopyPipeline
from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    gbps,
    machine_info,
    rate_fields,
)
from refit_lab.bench.references import Memcpy, MiB
from refit_lab.bench.relay import engine_config, state_bytes
from refit_lab.bench.runtime import ChildGroup, Deadline, torch_threads
from refit_lab.digest import state_digest
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_zmq.ipc import IpcOptions, IpcReceiver, IpcWeightSynchronizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sizes:
    """How much to move: the state, each ping-pong buffer, timed rounds, model width."""

    state_bytes: int
    buffer_bytes: int
    repeats: int
    hidden: int = 512


QUICK = Sizes(state_bytes=64 * MiB, buffer_bytes=16 * MiB, repeats=5)
FULL = Sizes(state_bytes=512 * MiB, buffer_bytes=16 * MiB, repeats=5)
_TIMEOUT_S = 300.0


class _Policy:
    """The trainer: its state as a source (already in the engine's dtype, nothing cast)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)


def _serve_engine(
    config: ReferenceModelConfig, address: str, refits: int, threads: int
) -> dict[str, int]:
    """Child: a reference engine serving ``refits`` refits on ``address``; its final digests."""
    torch.set_num_threads(threads)
    engine = ReferenceEngine(config)
    receiver = IpcReceiver(engine, bind_address=address)
    try:
        for _ in range(refits):
            receiver.serve_refit(timeout_s=_TIMEOUT_S)
    finally:
        receiver.close()
    return engine.state_digests()


def measure(ctx: BenchContext, sizes: Sizes) -> BenchReport:
    """Run the bench at ``sizes``."""
    config = engine_config(sizes.state_bytes, hidden=sizes.hidden)
    total = state_bytes(config)
    state = random_checkpoint(config, seed=0)
    address = f"ipc://{tempfile.gettempdir()}/refit-bench-ipc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    refits = sizes.repeats + 1
    memcpy_s: list[float] = []
    ipc_s: list[float] = []
    options = IpcOptions(buffer_size_bytes=sizes.buffer_bytes, device="cpu")
    pipeline_s: list[float] = []
    deadline = Deadline(_TIMEOUT_S + refits * total / 50e6, "ipc bench")
    side_threads = max(1, ctx.threads // 2)
    args = [(config, address, refits, side_threads)]
    memcpy = Memcpy(total, threads=ctx.threads)
    moved = 0
    with (
        ChildGroup(_serve_engine, args, deadline=deadline, name="ipc-engine") as child,
        IpcWeightSynchronizer(
            _Policy(state), lambda: [address], refit_timeout_s=_TIMEOUT_S, options=options
        ) as synchronizer,
        CopyPipeline(
            config,
            state,
            buffer_bytes=sizes.buffer_bytes,
            threads=side_threads,
            deadline=deadline,
        ) as pipeline,
        torch_threads(side_threads),
    ):
        synchronizer.sync_weights()  # warm-up: the child starts, buffers are touched
        pipeline.run()
        for index in range(sizes.repeats):
            ctx.progress(f"round {index + 1} of {sizes.repeats}", index / sizes.repeats)
            for tensor in state.values():
                tensor.neg_()
            memcpy_s.append(memcpy.seconds())
            pipeline_s.append(_seconds(pipeline.run))
            started = time.perf_counter()
            result = synchronizer.sync_weights()
            ipc_s.append(time.perf_counter() - started)
            moved = result.dense_bytes
        (digests,) = child.results()
        pipeline_exact = pipeline.digests() == state_digest(state.items())
    exact = digests == state_digest(state.items())
    ctx.progress("ipc done", 1.0)
    results: list[dict[str, object]] = [
        result_row("memcpy", total, memcpy_s),
        result_row("copy_pipeline", total, pipeline_s, buffer_bytes=sizes.buffer_bytes),
        result_row("ipc", moved, ipc_s, buffer_bytes=sizes.buffer_bytes, tensors=len(state)),
    ]
    return BenchReport(
        bench="ipc",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary={**summarize(results), "bitexact": exact and pipeline_exact},
    )


def _seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def result_row(case: str, nbytes: int, seconds: list[float], **extra: object) -> dict[str, object]:
    """A result row: the case's per-round seconds (round ``i`` of every row ran together),
    its rate in each round and their median."""
    rates = rate_fields("gbps", [gbps(nbytes, s) for s in seconds])
    return {"case": case, "nbytes": nbytes, **rates, "round_s": seconds, **extra}


def summarize(results: list[dict[str, object]]) -> dict[str, float]:
    """The summary ratios, from the rows' per-round seconds (paired round by round):
    ``ipc_fraction_of_memcpy`` (the target), ``ceiling_fraction_of_memcpy`` (the bare
    two-copy pipeline's, the most any channel that copies twice reaches here) and
    ``ipc_fraction_of_ceiling`` (how far the channel is from it)."""
    rows = {str(row["case"]): row for row in results}

    def paired(subject: str, reference: str) -> PairedRatio:
        return PairedRatio.of(
            subject_s=_floats(rows[subject]["round_s"]),
            reference_s=_floats(rows[reference]["round_s"]),
            nbytes=int(str(rows[subject]["nbytes"])),
            reference_nbytes=int(str(rows[reference]["nbytes"])),
        )

    return {
        **paired("ipc", "memcpy").summary("ipc_fraction_of_memcpy"),
        **paired("copy_pipeline", "memcpy").summary("ceiling_fraction_of_memcpy"),
        **paired("ipc", "copy_pipeline").summary("ipc_fraction_of_ceiling"),
    }


def _floats(values: object) -> list[float]:
    if not isinstance(values, list):
        raise TypeError(f"per-round seconds must be a list, got {values!r}")
    return [float(v) for v in values]


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: 64 MiB when quick, 512 MiB otherwise."""
    return measure(ctx, QUICK if ctx.quick else FULL)
