"""One rank of refit's reshard of the oracle's cases (forked by :mod:`megatron_oracle`).

The same path as :mod:`megatron_workers`: the planner's copies executed over an
:class:`~refit_nccl.AbortableProcessGroup` on gloo from the test's source shards; each
destination rank's result goes to ``<out>/<case>/refit<rank>.pt``. Destination tensors start
as zeros shaped by refit's own layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_model import CONFIG, megatron_shard, natural_state
from megatron_workers import SEED, reshard_plan
from nccl_workers import SETUP_S, connect
from refit_core.backend import Deadline
from refit_nccl.megatron.executor import execute_reshard
from refit_nccl.megatron.gpt import Parallelism


def refit_rank(proc: int, cases: list[dict[str, Any]], out_dir: Path) -> None:
    """Run every case ``proc`` takes part in."""
    groups = []  # kept open until the process exits: a peer may still be receiving
    for case in cases:
        plan = reshard_plan(case)
        if proc >= plan.world_size:
            continue
        group = connect(proc, plan.world_size, case["port"], name=case["name"])
        groups.append(group)
        state = natural_state(CONFIG, SEED)
        src = Parallelism(**case["src"])
        sources = megatron_shard(state, CONFIG, src, proc) if proc < plan.source_world else {}
        dst_rank = proc if plan.colocated else proc - plan.source_world
        destinations = {
            name: torch.zeros(layout.local_shape(dst_rank), dtype=torch.bfloat16)
            for name, layout in plan.destinations.items()
            if dst_rank in layout.holders
        }
        execute_reshard(plan, proc, sources, destinations, Deadline.after(SETUP_S), group)
        if destinations:
            torch.save(destinations, out_dir / case["name"] / f"refit{dst_rank}.pt")
        print(f"{case['name']}: done", flush=True)
