"""Bench `collective`: refit-nccl's packed broadcast against its references, and its deadline.

Throughput: a state of about 1000 transformer-shaped bf16 tensors is broadcast over gloo from
rank 0 to 1 and to 3 receivers, four ways interleaved round by round in the same processes:
one flat broadcast of a single buffer of the same bytes (``flat``, the limit); refit's
packed, pipelined buckets received straight into a destination laid out by the plan
(``packed``) or copied out of staging buffers into separate tensors as an engine's
load_weights does (``packed_copy``); ``packed`` again through refit-nccl's child-process
communicator (``packed_child``: the killable-child fallback, whose extra cost is one copy into
and one out of shared memory per bucket); and one broadcast per tensor (``per_tensor``, what
several peers do). refit-lab's own flat gloo reference runs too (``flat_reference``), in its
own processes, as a cross-check of the in-process ``flat``. Every receiver checks its bytes.
Summary ratios are medians of per-round ratios (the slowest rank's time per round), the
lowest over the receiver counts, each with its reference's median rate beside it
(``<ratio>_reference_gbps``).

Abort: three ranks, deadline 2 s, one receiver freezes itself (SIGSTOP) after its first bucket
of a transfer of at least 64 MiB; each survivor reports how long after its deadline its
RefitTimeoutError came, then the survivors rebuild a group and retry, timed until verified.
"""

from __future__ import annotations

import logging
import math
import signal
import statistics
import time
from typing import TYPE_CHECKING, Any

from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    TimingStats,
    gbps,
    machine_info,
    median_ratio,
    rate_fields,
)
from refit_lab.bench.references import gloo_broadcast_gbps, memcpy_gbps
from refit_lab.bench.runtime import ChildGroup, Deadline, free_port
from refit_lab.faults import fault_self

if TYPE_CHECKING:
    import torch

    from refit_nccl.backend import AbortableProcessGroup

logger = logging.getLogger(__name__)

MiB = 1 << 20
QUICK_BYTES = 64 * MiB
FULL_BYTES = 512 * MiB
ABORT_BYTES = 64 * MiB
TENSORS_PER_LAYER = 9
LAYERS = 111  # 999 tensors
BUCKET_BYTES = 4 * MiB  # fits in cache: packing then sending a 16 MiB bucket measured slower
NUM_BUFFERS = 4
RECEIVERS = (1, 3)
ABORT_DEADLINE_S = 2.0
SETUP_S = 120.0


def _hidden_size(total_bytes: int) -> int:
    """Hidden size (a multiple of 32) whose :func:`transformer_state` is about ``total_bytes``."""
    per_layer = total_bytes / LAYERS / 2  # bf16 elements per layer, about 8.5 h^2
    return max(32, round(math.sqrt(per_layer / 8.5) / 32) * 32)


def transformer_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``total_bytes`` of bf16 weights in 999 Llama-shaped tensors (random bits)."""
    import torch

    hidden = _hidden_size(total_bytes)
    inter, kv = 2 * hidden, hidden // 4
    shapes = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for suffix, shape in shapes.items():
            bits = torch.empty(shape, dtype=torch.int16).random_(generator=generator)
            state[f"model.layers.{layer}.{suffix}"] = bits.view(torch.bfloat16)
    return state


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _bitexact(expected: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> bool:
    import torch

    return expected.keys() == received.keys() and all(
        torch.equal(expected[n].view(torch.int16), received[n].view(torch.int16)) for n in expected
    )


def _connect(
    rank: int, world: int, port: int, name: str, timeout_s: float, *, in_child: bool = False
) -> AbortableProcessGroup:
    from refit_core.backend import Deadline as RefitDeadline
    from refit_nccl.backend import AbortableProcessGroup, ChildProcessGroup, GroupSpec

    spec = GroupSpec("127.0.0.1", port, rank, world, "gloo", name)
    group = ChildProcessGroup(spec) if in_child else AbortableProcessGroup(spec)
    group.connect(RefitDeadline.after(timeout_s))
    return group


CASES = ("flat", "packed", "packed_copy", "packed_child", "per_tensor")
"""Measured interleaved, round by round, in the same processes (fair under a noisy load)."""
RATIOS = {
    "packed_vs_flat_throughput": ("packed", "flat"),
    "packed_speedup_vs_per_tensor": ("packed", "per_tensor"),
    "packed_copy_vs_flat_throughput": ("packed_copy", "flat"),
    "packed_child_vs_packed_throughput": ("packed_child", "packed"),
}
"""Summary ratio -> (subject, reference): medians of per-round ratios, the lowest over the
receiver counts, each with its reference's rate."""


def _throughput_rank(
    rank: int,
    world: int,
    ports: tuple[int, int],
    total_bytes: int,
    rounds: int,
    threads: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One rank: ``rounds`` rounds of every case in :data:`CASES`, then a bitwise check."""
    import torch

    from refit_core import TensorSpec
    from refit_core.backend import CollectiveSenderSpec
    from refit_core.backend import Deadline as RefitDeadline
    from refit_nccl.backend import (
        PlanStorage,
        StagingBuffers,
        TransferPlan,
        agree_on_plan,
        receive_packed,
        send_packed,
    )

    torch.set_num_threads(threads)
    state = transformer_state(total_bytes)
    plan = TransferPlan.build(
        {n: TensorSpec.of(t) for n, t in state.items()},
        CollectiveSenderSpec("refit", BUCKET_BYTES, NUM_BUFFERS),
    )
    group = _connect(rank, world, ports[0], "bench-throughput", timeout_s)
    agree_on_plan(group, plan.digest, RefitDeadline.after(timeout_s))
    child = _connect(rank, world, ports[1], "bench-child", timeout_s, in_child=True)
    staging = StagingBuffers()
    flat = torch.zeros(_nbytes(state), dtype=torch.uint8)
    storage = PlanStorage(plan, torch.device("cpu"))
    dest = state if rank == 0 else {n: torch.zeros_like(t) for n, t in state.items()}
    if rank:
        del state  # regenerated for the check, to hold one copy less during the rounds

    def copy_out(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            dest[name].copy_(tensor)

    def run(case: str, deadline: RefitDeadline) -> None:
        via = child if case == "packed_child" else group
        if case == "flat":
            group.broadcast(flat, 0, deadline)
        elif case == "per_tensor":
            for tensor in dest.values():
                group.broadcast(tensor.view(-1), 0, deadline)
        elif rank == 0:
            send_packed(via, plan, dest.items(), deadline, staging=staging)
        elif case in ("packed", "packed_child"):
            receive_packed(via, plan, lambda _: None, deadline, into=storage)
        else:
            receive_packed(group, plan, copy_out, deadline, staging=staging)

    times: dict[str, list[float]] = {case: [] for case in CASES}
    exact = True
    for index in range(rounds):
        for case in CASES:
            deadline = RefitDeadline.after(timeout_s)
            group.barrier(deadline)
            start = time.perf_counter()
            run(case, deadline)
            times[case].append(time.perf_counter() - start)
            if rank and index == rounds - 1 and case != "flat":
                received = dest if case in ("packed_copy", "per_tensor") else storage.tensors()
                exact = exact and _bitexact(transformer_state(total_bytes), received)
                for tensor in [*dest.values(), *storage.tensors().values()]:
                    tensor.zero_()  # the next case must deliver again, not find these bytes
    group.abort("bench done")
    child.abort("bench done")
    return {"times": times, "bitexact": exact}


def rank_threads(ctx: BenchContext, world: int) -> int:
    """Torch threads per rank when ``world`` ranks share the bench's threads: oversubscribed
    thread pools stall every small copy (seconds per pass on a busy 2-core machine)."""
    return max(1, ctx.threads // world)


def measure_throughput(
    ctx: BenchContext, receivers: int, total_bytes: int, repeats: int
) -> tuple[dict[str, list[float]], bool]:
    """Per-round seconds of every case to ``receivers`` (the slowest rank's, warm-up round
    dropped), and whether every receiver got every case bitwise."""
    world = receivers + 1
    ports = (free_port(), free_port())
    deadline = Deadline(2 * SETUP_S + 150.0 * (repeats + 1), f"collective x{receivers}")
    threads = rank_threads(ctx, world)
    args = [
        (rank, world, ports, total_bytes, repeats + 1, threads, SETUP_S) for rank in range(world)
    ]
    with ChildGroup(_throughput_rank, args, deadline=deadline, name="throughput-rank") as ranks:
        results = ranks.results()
    seconds: dict[str, list[float]] = {}
    for case in CASES:
        per_round = zip(*(r["times"][case] for r in results), strict=True)
        seconds[case] = [max(times) for times in per_round][1:]
        logger.info(
            "%s to %d receivers: %.3f GB/s",
            case,
            receivers,
            gbps(total_bytes, TimingStats.from_samples(seconds[case]).median_s),
        )
    return seconds, all(r["bitexact"] for r in results)


def _abort_plan() -> tuple[dict[str, torch.Tensor], Any]:
    from refit_core import TensorSpec
    from refit_core.backend import CollectiveSenderSpec
    from refit_nccl.backend import TransferPlan

    state = transformer_state(ABORT_BYTES, seed=1)
    plan = TransferPlan.build(
        {n: TensorSpec.of(t) for n, t in state.items()},
        CollectiveSenderSpec("refit", BUCKET_BYTES, NUM_BUFFERS),
    )
    return state, plan


def _abort_rank(rank: int, ports: tuple[int, int], threads: int) -> dict[str, Any]:
    """A survivor: the transfer a receiver freezes in (how late its error came after its
    deadline), then a rebuilt group over the survivors and a retry (timed until verified)."""
    import torch

    from refit_core import RefitTimeoutError
    from refit_core.backend import Deadline as RefitDeadline
    from refit_nccl.backend import agree_on_plan, receive_packed, send_packed

    torch.set_num_threads(threads)
    state, plan = _abort_plan()
    received: dict[str, torch.Tensor] = {}
    armed_at: list[float] = []

    def keep(items: list[tuple[str, torch.Tensor]]) -> None:
        received.update((name, tensor.clone()) for name, tensor in items)

    def transfer(group: AbortableProcessGroup, deadline_s: float) -> None:
        agree_on_plan(group, plan.digest, RefitDeadline.after(SETUP_S))
        group.barrier(RefitDeadline.after(SETUP_S))
        deadline = RefitDeadline.after(deadline_s)
        assert deadline.at is not None
        armed_at.append(deadline.at)
        if rank == 0:
            send_packed(group, plan, state.items(), deadline)
        else:
            receive_packed(group, plan, keep, deadline)

    try:
        transfer(_connect(rank, 3, ports[0], "bench-abort", SETUP_S), ABORT_DEADLINE_S)
    except RefitTimeoutError:
        release_s = time.monotonic() - armed_at[-1]
    else:
        raise RuntimeError("a transfer to a frozen receiver completed")
    started = time.perf_counter()
    received.clear()
    survivors = _connect(rank, 2, ports[1], "bench-retry", SETUP_S)
    transfer(survivors, SETUP_S)
    rebuild_s = time.perf_counter() - started
    survivors.abort("bench done")
    exact = rank == 0 or _bitexact(state, received)
    return {"release_s": release_s, "rebuild_s": rebuild_s, "bitexact": exact}


def _victim_rank(port: int, threads: int) -> None:
    """The receiver that freezes itself after its first bucket (the bench kills it)."""
    import torch

    from refit_core.backend import Deadline as RefitDeadline
    from refit_nccl.backend import agree_on_plan, receive_packed

    torch.set_num_threads(threads)
    _, plan = _abort_plan()
    group = _connect(2, 3, port, "bench-abort", SETUP_S)
    agree_on_plan(group, plan.digest, RefitDeadline.after(SETUP_S))
    group.barrier(RefitDeadline.after(SETUP_S))
    receive_packed(group, plan, lambda _: fault_self(signal.SIGSTOP), RefitDeadline.after(SETUP_S))


def measure_abort(ctx: BenchContext) -> dict[str, float | bool]:
    """Release after the deadline (the last survivor's) and rebuild + retry time."""
    ports = (free_port(), free_port())
    deadline = Deadline(3 * SETUP_S, "collective abort")
    threads = rank_threads(ctx, 3)
    survivors = [(rank, ports, threads) for rank in (0, 1)]
    victim = ChildGroup(_victim_rank, [(ports[0], threads)], deadline=deadline, name="victim")
    survivor = ChildGroup(_abort_rank, survivors, deadline=deadline, name="survivor")
    with victim, survivor as ranks:
        results = ranks.results()
    return {
        "release_s": max(r["release_s"] for r in results),
        "rebuild_s": max(r["rebuild_s"] for r in results),
        "bitexact": all(r["bitexact"] for r in results),
    }


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: 64 MiB when quick, 512 MiB otherwise."""
    if ctx.quick:
        return measure(ctx, QUICK_BYTES, repeats=11)
    return measure(ctx, FULL_BYTES, repeats=5)


def measure(
    ctx: BenchContext, state_bytes: int, *, repeats: int, abort: bool = True
) -> BenchReport:
    """Throughput of a state of about ``state_bytes`` to every receiver count in
    :data:`RECEIVERS`, ``repeats`` timed rounds each; then the abort case unless ``abort`` is
    False."""
    total = _nbytes(transformer_state(state_bytes))
    steps = 1 + 2 * len(RECEIVERS) + abort
    done = 0

    def progress(message: str) -> None:
        nonlocal done
        ctx.progress(message, done / steps)
        done += 1

    progress(f"memcpy {total} bytes")
    memcpy = memcpy_gbps(total, repeats=repeats, threads=ctx.threads)
    results: list[dict[str, object]] = []
    ratios: dict[str, list[PairedRatio]] = {key: [] for key in RATIOS}
    exact = True
    for receivers in RECEIVERS:
        threads = rank_threads(ctx, receivers + 1)
        progress(f"refit-lab flat reference to {receivers}")
        reference = gloo_broadcast_gbps(
            total, repeats=repeats, threads=threads, world_size=receivers + 1
        )
        progress(f"flat, packed, packed_copy, per_tensor to {receivers}")
        seconds, ok = measure_throughput(ctx, receivers, total, repeats)
        exact = exact and ok
        for key, (subject, against) in RATIOS.items():
            ratios[key].append(
                PairedRatio.of(
                    subject_s=seconds[subject], reference_s=seconds[against], nbytes=total
                )
            )
        flat = [gbps(total, s) for s in seconds["flat"]]
        rates = {case: [gbps(total, s) for s in times] for case, times in seconds.items()}
        for case, rounds in {**rates, "flat_reference": [reference]}.items():
            results.append(
                {
                    "case": f"{case} x{receivers}",
                    "receivers": receivers,
                    "nbytes": total,
                    "tensors": TENSORS_PER_LAYER * LAYERS,
                    "bucket_bytes": BUCKET_BYTES if case.startswith("packed") else "",
                    "rank_threads": threads,
                    **rate_fields("gbps", rounds),
                    "vs_flat": (
                        median_ratio(rounds, flat)
                        if case in seconds
                        else reference / statistics.median(flat)
                    ),
                    "vs_memcpy": statistics.median(rounds) / memcpy,
                }
            )
    summary: dict[str, float | bool] = {"memcpy_gbps": memcpy}
    for key, pairs in ratios.items():
        summary.update(min(pairs, key=lambda pair: pair.ratio).summary(key))
    if abort:
        progress("abort: frozen receiver, deadline 2 s")
        released = measure_abort(ctx)
        results.append(
            {
                "case": "abort frozen receiver",
                "receivers": 2,
                "nbytes": _nbytes(transformer_state(ABORT_BYTES)),
                "deadline_s": ABORT_DEADLINE_S,
                "release_after_deadline_s": released["release_s"],
                "rebuild_and_retry_s": released["rebuild_s"],
            }
        )
        summary["abort_release_after_deadline_s"] = float(released["release_s"])
        summary["rebuild_and_retry_s"] = float(released["rebuild_s"])
        exact = exact and bool(released["bitexact"])
    summary["bitexact"] = exact
    ctx.progress("collective done", 1.0)
    return BenchReport(
        bench="collective",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary=summary,
    )
