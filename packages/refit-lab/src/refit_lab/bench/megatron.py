"""Bench `megatron`: refit-nccl's Megatron reshard, bytes against the bounds, time against a
flat broadcast.

For each layout change of a GPT model laid out the way Megatron-Core lays it out, the plan's
bytes sent are compared with the lower bound (what each destination rank needs and does not
hold) and with gather-then-broadcast; then every rank runs the plan over gloo in child
processes (median of the slowest rank per round, warm-up dropped), each destination checks its
shards bit for bit against shards cut from the global tensors, and the time is compared with one
flat gloo broadcast of the same bytes measured in the same run.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from refit_lab.bench.harness import BenchContext, BenchReport, TimingStats, gbps, machine_info
from refit_lab.bench.references import gloo_broadcast_gbps
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
    process: int, case: str, quick: bool, port: int, rounds: int, threads: int
) -> dict[str, Any]:
    """One process of a case: ``rounds`` timed reshards, then a bitwise check."""
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
    spec = GroupSpec("127.0.0.1", port, process, plan.world_size, "gloo", f"bench-{case}")
    group = AbortableProcessGroup(spec)
    group.connect(RefitDeadline.after(SETUP_S))
    times: list[float] = []
    for _ in range(rounds):
        deadline = RefitDeadline.after(SETUP_S)
        group.barrier(deadline)
        start = time.perf_counter()
        execute_reshard(plan, process, sources, destinations, deadline, group)
        times.append(time.perf_counter() - start)
    group.abort("bench done")
    exact = all(
        torch.equal(destinations[n].view(torch.int16), t.view(torch.int16))
        for n, t in expected.items()
    )
    return {"times": times, "bitexact": exact}


def _measure(ctx: BenchContext, case: str, plan: ReshardPlan, repeats: int) -> tuple[float, bool]:
    """Median reshard seconds (slowest rank per round) and whether every rank was exact."""
    port = free_port()
    threads = max(1, ctx.threads // plan.world_size)
    args = [(p, case, ctx.quick, port, repeats + 1, threads) for p in range(plan.world_size)]
    deadline = Deadline(SETUP_S + 60.0 * (repeats + 1), f"megatron {case}")
    with ChildGroup(_reshard_rank, args, deadline=deadline, name="reshard-rank") as ranks:
        results = ranks.results()
    slowest = [max(times) for times in zip(*(r["times"] for r in results), strict=True)][1:]
    return TimingStats.from_samples(slowest).median_s, all(r["bitexact"] for r in results)


def run(ctx: BenchContext) -> BenchReport:
    """Run every layout change; summary ratios are the worst over the changes."""
    repeats = 2 if ctx.quick else 4
    config = _config(ctx.quick)
    results: list[dict[str, object]] = []
    ratios: list[tuple[float, float, float]] = []
    exact = True
    for index, case in enumerate(CHANGES):
        ctx.progress(f"megatron {case}", index / len(CHANGES))
        plan = _plan(case, config)
        seconds, ok = _measure(ctx, case, plan, repeats)
        exact = exact and ok
        flat = gloo_broadcast_gbps(plan.sent_bytes, repeats=repeats, threads=ctx.threads)
        rate = gbps(plan.sent_bytes, seconds)
        ratios.append(
            (
                plan.sent_bytes / plan.lower_bound_bytes if plan.lower_bound_bytes else 1.0,
                plan.sent_bytes / plan.naive_bytes,
                flat / rate,
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
                "reshard_s": seconds,
                "gbps": rate,
                "flat_gbps": flat,
                "time_vs_flat_broadcast": flat / rate,
                "bitexact": ok,
            }
        )
        logger.info("megatron %s: %.3f s, %.2fx a flat broadcast", case, seconds, flat / rate)
    ctx.progress("megatron done", 1.0)
    return BenchReport(
        bench="megatron",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary={
            "bytes_vs_lower_bound": max(r[0] for r in ratios),
            "bytes_fraction_of_naive": max(r[1] for r in ratios),
            "time_vs_flat_broadcast": max(r[2] for r in ratios),
            "bitexact": exact,
        },
    )
