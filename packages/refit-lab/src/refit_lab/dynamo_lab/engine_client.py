"""An engine client (the part of vLLM's ``AsyncLLM`` Dynamo's RL routes call) backed by
reference engines: one replica per engine rank, each joining the trainer's gloo group (as
vLLM's receiver does, from ``init_info`` alone, by vLLM's rendezvous) and receiving vLLM's
packed broadcast through refit-nccl.

``collective_rpc`` runs a vLLM worker-extension method on every rank at once, as vLLM does:
``init_weight_transfer_engine(init_info)``, ``start_weight_update(is_checkpoint_format)``,
``update_weights(update_info)``, ``finish_weight_update()``. Faults can be injected per
method (fail with a message, or delay) and every call is logged, for tests to inspect.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import TensorSpec
from refit_core.backend import CollectiveSenderSpec, Deadline
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_nccl.backend import AbortableProcessGroup, GroupSpec, TransferPlan, receive_packed

__all__ = ["Fault", "ReferenceEngineClient"]

JOIN_S = 60.0
"""How long a rank waits for the group's other members (vLLM has no such deadline)."""
RECEIVE_S = 120.0
"""How long a rank waits for one update's broadcast before it gives up."""


@dataclass
class Fault:
    """What a method does before it runs: sleep ``delay_s``, then fail with ``fail`` if set."""

    delay_s: float = 0.0
    fail: str | None = None


@dataclass
class _Rank:
    """One engine rank: its replica of the model and its place in the trainer's group."""

    local_rank: int
    engine: ReferenceEngine
    group: AbortableProcessGroup | None = None
    updating: bool = False
    updates: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if self.group is not None:
            self.group.abort("replaced by a new group")
        self.group = AbortableProcessGroup(
            GroupSpec(
                init_info["master_address"],
                int(init_info["master_port"]),
                int(init_info["rank_offset"]) + self.local_rank,
                int(init_info["world_size"]),
                "gloo",
                "vllm-receiver",
                rendezvous="vllm",
            )
        )
        self.group.connect(Deadline.after(JOIN_S))

    def start_weight_update(self, is_checkpoint_format: bool = False) -> None:
        if self.updating:
            raise RuntimeError("a weight update is already active")
        self.updating = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if not self.updating or self.group is None:
            raise RuntimeError("update_weights outside a started update or without a group")
        info = {
            name: TensorSpec(tuple(shape), dtype)
            for name, dtype, shape in zip(
                update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True
            )
        }
        geometry = CollectiveSenderSpec(
            "vllm", update_info["packed_buffer_size_bytes"], update_info["packed_num_buffers"]
        )
        plan = TransferPlan.build(info, geometry)
        receive_packed(self.group, plan, self._load, Deadline.after(RECEIVE_S))

    def _load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(batch)

    def finish_weight_update(self) -> None:
        if not self.updating:
            raise RuntimeError("no weight update is active")
        self.updating = False
        self.updates += 1


class ReferenceEngineClient:
    """vLLM's engine client surface over ``engine_world_size`` reference-engine ranks."""

    def __init__(self, config: ReferenceModelConfig, seed: int) -> None:
        self._config = config
        self._seed = seed
        self.faults: dict[str, Fault] = {}
        self.calls: list[str] = []
        self.paused = False
        self.ranks: list[_Rank] = []
        self.configure(1)

    def configure(self, engine_world_size: int) -> None:
        """Start over with ``engine_world_size`` fresh ranks (aborting any old group)."""
        for rank in self.ranks:
            if rank.group is not None:
                rank.group.abort("reconfigured")
        self.ranks = [
            _Rank(i, ReferenceEngine(self._config, seed=self._seed))
            for i in range(engine_world_size)
        ]

    def state(self) -> dict[str, Any]:
        """What the tests check: per-rank digests and update counts, pause state, call log."""
        return {
            "paused": self.paused,
            "calls": list(self.calls),
            "ranks": [
                {"digest": r.engine.combined_digest(), "updates": r.updates, "updating": r.updating}
                for r in self.ranks
            ],
        }

    def digests(self) -> list[dict[str, int]]:
        """Every rank's per-tensor bitwise digests, under checkpoint names."""
        return [rank.engine.state_digests() for rank in self.ranks]

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[list[int]]]:
        """Every rank's greedy continuations of ``prompts``."""
        return [rank.engine.generate(prompts, max_new_tokens).tokens for rank in self.ranks]

    async def _enter(self, method: str) -> None:
        self.calls.append(method)
        fault = self.faults.get(method)
        if fault is None:
            return
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault.fail is not None:
            raise RuntimeError(fault.fail)

    async def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        """Run ``method(**kwargs)`` on every rank concurrently; the first error is raised."""
        await self._enter(method)

        def run(rank: _Rank) -> None:
            with rank.lock:
                getattr(rank, method)(**kwargs)

        await asyncio.gather(*(asyncio.to_thread(run, rank) for rank in self.ranks))

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        await self._enter("pause_generation")
        self.paused = True
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        await self._enter("resume_generation")
        self.paused = False

    async def reset_prefix_cache(self) -> None:
        await self._enter("reset_prefix_cache")
        for rank in self.ranks:
            rank.engine.reset_prefix_cache()
