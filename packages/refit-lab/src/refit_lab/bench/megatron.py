"""Bench `megatron`: refit-nccl's Megatron reshard, bytes against the bounds, time against a
flat broadcast.

For each layout change of a GPT model laid out the way Megatron-Core lays it out, the plan's
bytes sent are compared with the lower bound (what each destination rank needs and does not
hold) and with gather-then-broadcast; then every rank runs the plan over gloo in child
processes (slowest rank per round, warm-up dropped), each destination checks its shards bit for
bit against shards cut from the global tensors. Every round also times one flat gloo broadcast
of the same bytes between processes 0 and 1 of the same run (their own 2-process group);
``time_vs_flat_broadcast`` is the median of the per-round ratios of reshard time to flat time,
with the flat broadcast's own rate beside it.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any

from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    machine_info,
    rate_fields,
)
from refit_lab.bench.runtime import ChildGroup, Deadline, free_port

if TYPE_CHECKING:
    import torch

    from refit_nccl.megatron import GPTConfig, ParamLayout, ReshardPlan

logger = logging.getLogger(__name__)

SETUP_S = 120.0
CHANGES: dict[str, tuple[dict[str, int], dict[str, int], bool]] = {
    "tp2->1": ({"tp": 2}, {"tp": 1}, False),
    "tp1->2": ({"tp": 1}, {"tp": 2}, False),
    "tp4->2": ({"tp": 4}, {"tp": 2}, False),
    "pp2->1": ({"pp": 2}, {"pp": 1}, False),
    "colocated tp4->2": ({"tp": 4}, {"tp": 2}, True),
}
"""Case -> (source parallelism, destination parallelism, colocated)."""


def _config(quick: bool) -> GPTConfig:
    from refit_nccl.megatron import GPTConfig

    if quick:  # about 34 MB of bf16
        return GPTConfig(layers=4, hidden=512, heads=8, query_groups=4, ffn=1536, vocab=4096)
    return GPTConfig(layers=8, hidden=1024, heads=8, query_groups=4, ffn=4096, vocab=8192)


def _plan(case: str, config: GPTConfig) -> ReshardPlan:
    from refit_nccl.megatron import Parallelism, gpt_layouts, plan_reshard

    src, dst, colocated = CHANGES[case]
    return plan_reshard(
        gpt_layouts(config, Parallelism(**src)),
        gpt_layouts(config, Parallelism(**dst)),
        colocated=colocated,
    )


def _global_state(layouts: dict[str, ParamLayout]) -> dict[str, torch.Tensor]:
    """Random bf16 bits for every parameter, the same in every process."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.empty(layouts[name].shape, dtype=torch.int16)
        .random_(generator=generator)
        .view(torch.bfloat16)
        for name in sorted(layouts)
    }


def _cut(
    state: dict[str, torch.Tensor], layouts: dict[str, ParamLayout], rank: int | None
) -> dict[str, torch.Tensor]:
    """``rank``'s shards of ``state`` under ``layouts`` (none for rank None)."""
    import torch

    if rank is None:
        return {}
    return {
        name: torch.cat(
            [state[name].narrow(lay.dim, s.start, len(s)) for s in lay.holders[rank]], lay.dim
        )
        for name, lay in layouts.items()
        if rank in lay.holders
    }


def _reshard_rank(
    process: int, case: str, quick: bool, ports: tuple[int, int], rounds: int, threads: int
) -> dict[str, Any]:
    """One process of a case: ``rounds`` rounds of a timed reshard, then (processes 0 and 1
    only) a timed flat broadcast of the same bytes over their own 2-process group; then a
    bitwise check."""
    import torch

    from refit_core.backend import Deadline as RefitDeadline
    from refit_nccl.backend import AbortableProcessGroup, GroupSpec
    from refit_nccl.megatron import execute_reshard

    torch.set_num_threads(threads)
    plan = _plan(case, _config(quick))
    sources_layouts, dst_layouts = dict(plan.sources), dict(plan.destinations)
    state = _global_state(sources_layouts)
    src_rank = process if process < plan.source_world else None
    dst_rank = process if plan.colocated else process - plan.source_world
    dst_rank_or_none = dst_rank if 0 <= dst_rank < plan.destination_world else None
    sources = _cut(state, sources_layouts, src_rank)
    expected = _cut(state, dst_layouts, dst_rank_or_none)
    destinations = {name: torch.zeros_like(t) for name, t in expected.items()}
    spec = GroupSpec("127.0.0.1", ports[0], process, plan.world_size, "gloo", f"bench-{case}")
    group = AbortableProcessGroup(spec)
    group.connect(RefitDeadline.after(SETUP_S))
    flat = None
    if process < 2:
        flat_spec = GroupSpec("127.0.0.1", ports[1], process, 2, "gloo", f"bench-{case}-flat")
        flat = AbortableProcessGroup(flat_spec)
        flat.connect(RefitDeadline.after(SETUP_S))
    buffer = torch.full((plan.sent_bytes,), 0xA5 if process == 0 else 0, dtype=torch.uint8)
    times: list[float] = []
    flat_times: list[float] = []
    for _ in range(rounds):
        deadline = RefitDeadline.after(SETUP_S)
        group.barrier(deadline)
        start = time.perf_counter()
        execute_reshard(plan, process, sources, destinations, deadline, group)
        times.append(time.perf_counter() - start)
        group.barrier(deadline)
        start = time.perf_counter()
        if flat is not None:
            flat.broadcast(buffer, 0, deadline)
        flat_times.append(time.perf_counter() - start)
    group.abort("bench done")
    if flat is not None:
        flat.abort("bench done")
    exact = all(
        torch.equal(destinations[n].view(torch.int16), t.view(torch.int16))
        for n, t in expected.items()
    ) and (flat is None or bool((buffer == 0xA5).all()))
    return {"times": times, "flat_times": flat_times, "bitexact": exact}


def _measure(
    ctx: BenchContext, case: str, plan: ReshardPlan, repeats: int
) -> tuple[list[float], list[float], bool]:
    """Per-round seconds (slowest process, warm-up dropped) of the reshard and of the flat
    broadcast, and whether every process was exact."""
    ports = (free_port(), free_port())
    threads = max(1, ctx.threads // plan.world_size)
    args = [(p, case, ctx.quick, ports, repeats + 1, threads) for p in range(plan.world_size)]
    deadline = Deadline(SETUP_S + 60.0 * (repeats + 1), f"megatron {case}")
    with ChildGroup(_reshard_rank, args, deadline=deadline, name="reshard-rank") as ranks:
        results = ranks.results()

    def slowest(key: str) -> list[float]:
        return [max(times) for times in zip(*(r[key] for r in results), strict=True)][1:]

    return slowest("times"), slowest("flat_times"), all(r["bitexact"] for r in results)


def run(ctx: BenchContext) -> BenchReport:
    """Run every layout change; summary ratios are the worst over the changes."""
    repeats = 2 if ctx.quick else 4
    config = _config(ctx.quick)
    results: list[dict[str, object]] = []
    ratios: list[tuple[float, float, PairedRatio]] = []
    exact = True
    for index, case in enumerate(CHANGES):
        ctx.progress(f"megatron {case}", index / len(CHANGES))
        plan = _plan(case, config)
        seconds, flat_seconds, ok = _measure(ctx, case, plan, repeats)
        exact = exact and ok
        vs_flat = PairedRatio.of(
            subject_s=seconds, reference_s=flat_seconds, nbytes=plan.sent_bytes
        )
        ratios.append(
            (
                plan.sent_bytes / plan.lower_bound_bytes if plan.lower_bound_bytes else 1.0,
                plan.sent_bytes / plan.naive_bytes,
                vs_flat,
            )
        )
        results.append(
            {
                "case": case,
                "processes": plan.world_size,
                "model_bytes": sum(lay.nbytes for lay in plan.sources.values()),
                "sent_bytes": plan.sent_bytes,
                "lower_bound_bytes": plan.lower_bound_bytes,
                "naive_bytes": plan.naive_bytes,
                "copies": len(plan.copies),
                "reshard_s": statistics.median(seconds),
                **rate_fields("gbps", vs_flat.subject_rounds_gbps),
                **rate_fields("flat_gbps", vs_flat.reference_rounds_gbps),
                "time_vs_flat_broadcast": vs_flat.time_ratio,
                "bitexact": ok,
            }
        )
        logger.info("megatron %s: %.2fx a flat broadcast's time", case, vs_flat.time_ratio)
    worst = max(ratios, key=lambda r: r[2].time_ratio)[2]
    ctx.progress("megatron done", 1.0)
    return BenchReport(
        bench="megatron",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary={
            "bytes_vs_lower_bound": max(r[0] for r in ratios),
            "bytes_fraction_of_naive": max(r[1] for r in ratios),
            **worst.summary("time_vs_flat_broadcast", time=True),
            "bitexact": exact,
        },
    )
