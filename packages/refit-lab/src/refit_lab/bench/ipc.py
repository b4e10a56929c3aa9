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
from dataclasses import dataclass

import torch

from refit_core.sources import StateDictSource
from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
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
        torch_threads(side_threads),
    ):
        synchronizer.sync_weights()  # warm-up: the child starts, buffers are touched
        for index in range(sizes.repeats):
            ctx.progress(f"round {index + 1} of {sizes.repeats}", index / sizes.repeats)
            for tensor in state.values():
                tensor.neg_()
            memcpy_s.append(memcpy.seconds())
            started = time.perf_counter()
            result = synchronizer.sync_weights()
            ipc_s.append(time.perf_counter() - started)
            moved = result.dense_bytes
        (digests,) = child.results()
    exact = digests == state_digest(state.items())
    paired = PairedRatio.of(
        subject_s=ipc_s, reference_s=memcpy_s, nbytes=moved, reference_nbytes=total
    )
    ctx.progress("ipc done", 1.0)
    results: list[dict[str, object]] = [
        {"case": "memcpy", "nbytes": total, **rate_fields("gbps", paired.reference_rounds_gbps)},
        {
            "case": "ipc",
            "nbytes": moved,
            **rate_fields("gbps", paired.subject_rounds_gbps),
            "buffer_bytes": sizes.buffer_bytes,
            "tensors": len(state),
        },
    ]
    return BenchReport(
        bench="ipc",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary={**paired.summary("ipc_fraction_of_memcpy"), "bitexact": exact},
    )


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: 64 MiB when quick, 512 MiB otherwise."""
    return measure(ctx, QUICK if ctx.quick else FULL)
