"""An engine client (the part of vLLM's ``AsyncLLM`` Dynamo's RL routes call) backed by
reference engines: one replica per engine rank, each joining the trainer's gloo group (as
vLLM's receiver does, from ``init_info`` alone, by vLLM's rendezvous) and receiving vLLM's
packed broadcast through refit-nccl.

``collective_rpc`` runs a vLLM worker method on every rank at once, as vLLM does, with vLLM's
signatures and parsing (``vllm/v1/worker/gpu_worker.py`` and ``distributed/weight_transfer/
nccl_common.py`` / ``nccl_engine.py``, the same in vLLM 0.31.0 and 0.32.0):
``init_weight_transfer_engine(init_info)`` (the fields of ``NCCLWeightTransferInitInfo``,
packing geometry included; packed defaults to false), ``start_weight_update()``,
``update_weights(update_info)`` (exactly ``names``, ``dtype_names``, ``shapes``: vLLM's
``parse_update_info`` refuses any other key), ``finish_weight_update()``. The engine tier checks
these bodies against vLLM's own classes (``tests/engine/test_dynamo_vllm.py``). Faults can be
injected per method (fail with a message, or delay) and every call is logged, for tests to
inspect.

With ``REFIT_LAB_RECEIVER=vllm-nccl`` in the worker's environment each rank joins and receives
the way vLLM's ``NCCLWeightTransferEngine`` does, with vLLM's own code on GPU ``local_rank``
(``stateless_init_process_group`` from the parsed ``NCCLWeightTransferInitInfo``, then
``packed_nccl_broadcast_consumer`` over the parsed update info); it needs a CUDA build of vLLM.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import TensorSpec
from refit_core.backend import CollectiveSenderSpec, Deadline
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_nccl.backend import AbortableProcessGroup, GroupSpec, TransferPlan, receive_packed

__all__ = ["RECEIVER_ENV", "Fault", "ReferenceEngineClient"]

RECEIVER_ENV = "REFIT_LAB_RECEIVER"
"""``vllm-nccl``: ranks receive with vLLM's own NCCL worker code; otherwise over refit's gloo
group by vLLM's rendezvous."""

JOIN_S = 60.0
"""How long a rank waits for the group's other members (vLLM has no such deadline)."""
RECEIVE_S = 120.0
"""How long a rank waits for one update's broadcast before it gives up."""


@dataclass
class Fault:
    """What a method does before it runs: sleep ``delay_s``, then fail with ``fail`` if set."""

    delay_s: float = 0.0
    fail: str | None = None


_INIT_FIELDS = {
    "master_address": None,
    "master_port": None,
    "rank_offset": None,
    "world_size": None,
    "nccl_unique_id_b64": None,
    "packed": False,
    "packed_buffer_size_bytes": 1 << 30,
    "packed_num_buffers": 2,
}
"""``NCCLWeightTransferInitInfo``'s fields and defaults (None: no default used here)."""
_UPDATE_FIELDS = ("names", "dtype_names", "shapes")
"""``NCCLWeightTransferUpdateInfo``'s fields."""


def _parsed(info: dict[str, Any], fields: Any, kind: str) -> dict[str, Any]:
    """``info`` with its defaults filled in; ValueError for an unknown key, as vLLM's
    ``parse_init_info`` / ``parse_update_info`` raise."""
    unknown = sorted(set(info) - set(fields))
    if unknown:
        raise ValueError(f"Invalid {kind}: unexpected keyword argument {unknown[0]!r}")
    defaults = fields if isinstance(fields, dict) else {}
    return {**{k: v for k, v in defaults.items() if v is not None}, **info}


@dataclass
class _Rank:
    """One engine rank: its replica of the model and its place in the trainer's group."""

    local_rank: int
    engine: ReferenceEngine
    group: AbortableProcessGroup | None = None
    vllm_comm: Any = None
    """vLLM's ``PyNcclCommunicator`` (``REFIT_LAB_RECEIVER=vllm-nccl``)."""
    updating: bool = False
    updates: int = 0
    geometry: CollectiveSenderSpec | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if os.environ.get(RECEIVER_ENV) == "vllm-nccl":
            self._join_vllm_nccl(init_info)
            return
        init_info = _parsed(init_info, _INIT_FIELDS, "init_info")
        if not init_info["packed"]:
            raise ValueError("the lab receives vLLM's packed broadcast only (packed: true)")
        self.geometry = CollectiveSenderSpec(
            "vllm", init_info["packed_buffer_size_bytes"], init_info["packed_num_buffers"]
        )
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

    def start_weight_update(self) -> None:
        if self.updating:
            raise RuntimeError("a weight update is already active")
        self.updating = True

    def _join_vllm_nccl(self, init_info: dict[str, Any]) -> None:
        """What vLLM's worker runs (``worker_init_process_group``), on GPU ``local_rank``."""
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            stateless_init_process_group,
        )

        info = NCCLWeightTransferInitInfo(**init_info)
        assert info.master_address is not None and info.master_port is not None
        torch.cuda.set_device(self.local_rank)
        self.geometry = CollectiveSenderSpec(
            "vllm", info.packed_buffer_size_bytes, info.packed_num_buffers
        )
        self.vllm_comm = stateless_init_process_group(
            info.master_address,
            info.master_port,
            info.rank_offset + self.local_rank,
            info.world_size,
            device=self.local_rank,
        )

    def _receive_vllm_nccl(self, update_info: dict[str, Any]) -> None:
        """What vLLM's ``NCCLWeightTransferEngine.receive_weights`` runs when packed."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        info = NCCLWeightTransferUpdateInfo(**update_info)
        assert self.geometry is not None
        torch.cuda.set_device(self.local_rank)
        packed_nccl_broadcast_consumer(
            iterator=(
                (name, (shape, getattr(torch, dtype)))
                for name, dtype, shape in zip(
                    info.names, info.dtype_names, info.shapes, strict=True
                )
            ),
            group=self.vllm_comm,
            src=0,
            post_unpack_func=lambda items: self._load([(n, t.cpu()) for n, t in items]),
            buffer_size_bytes=self.geometry.buffer_size_bytes,
            num_buffers=self.geometry.num_buffers,
            device=f"cuda:{self.local_rank}",
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.updating and self.vllm_comm is not None:
            self._receive_vllm_nccl(update_info)
            return
        if not self.updating or self.group is None or self.geometry is None:
            raise RuntimeError("update_weights outside a started update or without a group")
        update_info = _parsed(update_info, _UPDATE_FIELDS, "update_info")
        info = {
            name: TensorSpec(tuple(shape), dtype)
            for name, dtype, shape in zip(
                update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True
            )
        }
        plan = TransferPlan.build(info, self.geometry)
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
