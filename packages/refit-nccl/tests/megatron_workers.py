"""Worker processes of the multi-process reshard tests (imported by name in spawned children)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any

import torch

from megatron_model import CONFIG, FixedCluster, Side, megatron_shard, natural_state
from nccl_workers import SETUP_S, Report, connect
from refit_core.backend import Deadline, SynchronizerRequest
from refit_lab.faults import fault_self
from refit_nccl.megatron.builder import build_collective_reshard
from refit_nccl.megatron.executor import execute_reshard
from refit_nccl.megatron.gpt import Parallelism, gpt_layouts
from refit_nccl.megatron.plan import ReshardPlan, plan_reshard

SEED = 11


def reshard_plan(step: Report) -> ReshardPlan:
    """The plan of a step (``src`` / ``dst``: Parallelism fields; ``colocated``)."""
    src, dst = Parallelism(**step["src"]), Parallelism(**step["dst"])
    return plan_reshard(
        gpt_layouts(CONFIG, src), gpt_layouts(CONFIG, dst), colocated=step["colocated"]
    )


def _run_step(proc: int, step: Report) -> Report | None:
    plan = reshard_plan(step)
    rank = proc
    if rank >= plan.world_size:
        return None
    src, dst = Parallelism(**step["src"]), Parallelism(**step["dst"])
    state = natural_state(CONFIG, SEED)
    group = connect(rank, plan.world_size, step["port"], name=step["name"])
    if rank == step.get("victim"):
        fault_self(signal.Signals[step["signal"]])
    sources = megatron_shard(state, CONFIG, src, rank) if rank < plan.source_world else {}
    dst_rank = rank if plan.colocated else rank - plan.source_world
    is_destination = 0 <= dst_rank < plan.destination_world
    expected = megatron_shard(state, CONFIG, dst, dst_rank) if is_destination else {}
    destinations = {
        name: sources[name] if step.get("alias") else torch.zeros_like(tensor)
        for name, tensor in expected.items()
    }
    deadline = Deadline.after(step.get("deadline_s", SETUP_S))
    started = time.monotonic()
    try:
        stats = execute_reshard(plan, rank, sources, destinations, deadline, group)
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "after_deadline_s": time.monotonic() - started - step.get("deadline_s", SETUP_S),
        }
    wrong = [
        name
        for name, tensor in expected.items()
        if not torch.equal(destinations[name].view(torch.int16), tensor.view(torch.int16))
    ]
    return {"error": None, "wrong": wrong, "stats": dataclasses.asdict(stats), "dst": dst_rank}


def _run_synchronizer(proc: int, step: Report) -> Report | None:
    """Two refits through the builder of the (megatron, non-colocated, collective) row."""
    plan = reshard_plan(step)
    if proc >= plan.world_size:
        return None
    src, dst = Parallelism(**step["src"]), Parallelism(**step["dst"])
    is_source = proc < plan.source_world
    dst_rank = None if is_source else proc - plan.source_world
    wrong: list[str] = []
    policy = Side(gpt_layouts(CONFIG, src), proc if is_source else None)
    generation = Side(gpt_layouts(CONFIG, dst), dst_rank)
    if dst_rank is not None:
        generation.shards = {
            name: torch.zeros_like(t)
            for name, t in megatron_shard(natural_state(CONFIG, 0), CONFIG, dst, dst_rank).items()
        }
    request = SynchronizerRequest(
        policy,
        generation,
        "megatron",
        False,
        "collective",
        FixedCluster(step["port"]),
        FixedCluster(step["port"]),
        refit_timeout_s=SETUP_S,
    )
    with build_collective_reshard(request) as synchronizer:
        for version in (1, 2):
            state = natural_state(CONFIG, SEED + version)
            if is_source:
                policy.shards = megatron_shard(state, CONFIG, src, proc)
            result = synchronizer.sync_weights(version)
            if dst_rank is not None:
                expected = megatron_shard(state, CONFIG, dst, dst_rank)
                wrong += [
                    f"v{version} {name}"
                    for name, tensor in expected.items()
                    if not torch.equal(generation.shards[name], tensor)
                ]
    return {"error": None, "wrong": wrong, "version": result.version}


def run(results: Any, proc: int, steps: list[Report]) -> None:
    """Process entry point: run each step this process takes part in; put one report each."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    for step in steps:
        try:
            runner = _run_synchronizer if step.get("synchronizer") else _run_step
            report = runner(proc, step)
        except Exception as exc:
            report = {"error": "crash", "message": f"{type(exc).__name__}: {exc}"}
        if report is not None:
            results.put({"proc": proc, "step": step["name"], **report})
