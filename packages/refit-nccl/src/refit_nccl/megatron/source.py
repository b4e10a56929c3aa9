"""The Megatron source: TP / PP / EP shards -> HF checkpoint tensors, one bucket at a time.

Every rank of the trainer's Megatron world iterates the source in lock step, over an
:class:`~refit_nccl.AbortableProcessGroup` of that world (group rank = Megatron global rank).
Before the first bucket one all-reduce checks that every rank holds exactly the shards its
layout gives it and planned the same buckets; otherwise every rank raises
:class:`~refit_core.GeometryMismatchError`. Then, bucket by bucket and parameter by parameter,
in the same order on every rank: each holder casts its shard once to the engine's dtype, and the
reshard executor gathers the parameter on the sending rank (a plan from the training layout to
"whole on the sender": each piece comes from one holder, the sender's own pieces are copied
locally). The sender un-interleaves ``linear_qkv`` and cuts q / k / v and gate / up
(:mod:`refit_nccl.megatron.hf`); every other rank drops its cast shard when the gather returns.

Deadline: the check and each bucket's gathers run under ``Deadline.after(gather_timeout_s)``;
past it (or when a peer dies) the group is aborted, :class:`~refit_core.RefitTimeoutError` is
raised, and later iterations raise :class:`~refit_core.RefitAbortedError`: build a new group.

Memory bound, with U the largest unit and B = max(bucket_size_bytes, U), both in the engine's
dtype: the sender holds at most B + 2U extra (the bucket, plus one cast shard and one gathered
``linear_qkv`` before its reorder), every other rank at most 2U (one cast shard and one
contiguous copy of a row-parallel slice in flight), whatever the model's size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import torch

from refit_core import GeometryMismatchError, NamedTensor, StateDictInfo, TensorSpec
from refit_core.backend import (
    ENGINE_DTYPES,
    Deadline,
    Unit,
    build_plan,
    cast_once,
    fingerprint,
    materialize,
    pack_buckets,
    plan_info,
)
from refit_core.sources import Bucket, CollectiveOrderGuard, NameMap
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.megatron.executor import execute_reshard
from refit_nccl.megatron.gpt import GPTConfig, Parallelism, gpt_layouts
from refit_nccl.megatron.hf import hf_name_map, to_checkpoint_layout
from refit_nccl.megatron.layout import ParamLayout, Span
from refit_nccl.megatron.plan import plan_reshard
from refit_nccl.megatron.synchronizer import Shards

__all__ = ["MegatronSource"]

logger = logging.getLogger(__name__)


class MegatronSource:
    """A Megatron-Core GPT trainer's shards as a bounded-memory stream of HF checkpoint tensors.

    Satisfies :class:`~refit_core.sources.ShardedWeightSource`.

    Args:
        config: the model's shape.
        parallelism: the trainer's layout; ``group`` has its world size.
        shards: returns this rank's shards by global name (layer and expert numbers global,
            as in :func:`~refit_nccl.megatron.gpt_layouts`), read on every iteration.
        group: a connected group of the trainer's ranks, rank = Megatron global rank.
        params_dtype: the dtype the trainer keeps its parameters in (fp32 masters: float32).
        dtype: the engine's dtype; shards are cast to it once, before the gather. None keeps
            ``params_dtype``.
        name_map: Megatron name -> checkpoint names; :func:`~refit_nccl.megatron.hf.hf_name_map`
            (HF names, q / k / v and gate / up split) by default.
        bucket_size_bytes: bytes (engine dtype) gathered before a bucket is yielded; None
            yields one unit per bucket.
        sender_rank: the rank that keeps and yields the gathered tensors.
        gather_timeout_s: deadline of the check and of each bucket's gathers (None disarms).
        order_guard: guard shared with the consumer's collectives; a new one by default.

    Raises:
        ValueError: the layout does not fit ``config`` or ``group``, or a bad argument.
    """

    def __init__(
        self,
        config: GPTConfig,
        parallelism: Parallelism,
        shards: Shards,
        group: AbortableProcessGroup,
        *,
        params_dtype: str = "bfloat16",
        dtype: str | None = None,
        name_map: NameMap | None = None,
        bucket_size_bytes: int | None = None,
        sender_rank: int = 0,
        gather_timeout_s: float | None = 60.0,
        order_guard: CollectiveOrderGuard | None = None,
    ) -> None:
        if group.world_size != parallelism.world_size:
            raise ValueError(
                f"group of {group.world_size} ranks, but {parallelism} needs "
                f"{parallelism.world_size}"
            )
        if not 0 <= sender_rank < group.world_size:
            raise ValueError(f"sender_rank {sender_rank} is not in a world of {group.world_size}")
        if params_dtype not in ENGINE_DTYPES:
            raise ValueError(f"params_dtype must be one of {sorted(ENGINE_DTYPES)}")
        if bucket_size_bytes is not None and bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be > 0 or None, got {bucket_size_bytes}")
        self._config = config
        self._parallelism = parallelism
        self._layouts = gpt_layouts(config, parallelism)
        self._shards = shards
        self._group = group
        self._params_dtype = params_dtype
        self._dtype = dtype
        self._name_map = name_map if name_map is not None else hf_name_map(config)
        self._bucket_size_bytes = bucket_size_bytes
        self._sender = sender_rank
        self._timeout_s = gather_timeout_s
        self._guard = order_guard if order_guard is not None else CollectiveOrderGuard()

    @property
    def order_guard(self) -> CollectiveOrderGuard:
        """The guard this source's gathers and its consumer's collectives share."""
        return self._guard

    @property
    def sends(self) -> bool:
        """Whether this rank keeps and yields the gathered tensors."""
        return self._group.rank == self._sender

    def state_dict_info(self) -> StateDictInfo:
        """Checkpoint name -> spec of every tensor (global shapes; no collective)."""
        return plan_info(self._units())

    def iter_buckets(self) -> Iterator[Bucket]:
        """Yield every bucket, gathered in full on the sender before it is yielded, on every
        rank (tensors only on the sender).

        Raises:
            GeometryMismatchError: some rank's shards or plan differ from the layout's.
            RefitTimeoutError: a gather passed its deadline or a peer was lost.
            RefitAbortedError: the group was aborted.
        """
        buckets = pack_buckets(self._units(), self._bucket_size_bytes)
        shards = self._shards()
        with self._guard.gather():
            self._check(shards, buckets, Deadline.after(self._timeout_s))
        for index, bucket in enumerate(buckets):
            with self._guard.gather():
                deadline = Deadline.after(self._timeout_s)
                tensors = [t for unit in bucket for t in self._gather_unit(unit, shards, deadline)]
            logger.debug("bucket %d: %d units gathered, kept=%s", index, len(bucket), self.sends)
            yield Bucket(index, plan_info(bucket), tuple(tensors))

    def iter_tensors(self) -> Iterator[NamedTensor]:
        """Every bucket's tensors, in order (nothing on a rank that does not send)."""
        for bucket in self.iter_buckets():
            yield from bucket.tensors

    def _units(self) -> tuple[Unit, ...]:
        specs = (
            (name, TensorSpec(layout.shape, self._params_dtype))
            for name, layout in self._layouts.items()
        )
        return build_plan(specs, self._name_map, self._dtype)

    def _gather_unit(
        self, unit: Unit, shards: Mapping[str, torch.Tensor], deadline: Deadline
    ) -> list[NamedTensor]:
        whole: list[torch.Tensor] = []
        for name, dtype in unit.inputs:
            gathered = self._gather(name, dtype, shards, deadline)
            if gathered is not None:
                whole.append(to_checkpoint_layout(name, gathered, self._config))
        return materialize(unit, whole) if self.sends else []

    def _gather(
        self, name: str, dtype: str, shards: Mapping[str, torch.Tensor], deadline: Deadline
    ) -> torch.Tensor | None:
        """Parameter ``name`` cast to ``dtype`` and whole on the sender; None elsewhere."""
        layout = self._layouts[name]
        size = layout.shape[layout.dim]
        whole = ParamLayout(
            layout.shape, layout.itemsize, layout.dim, {self._sender: (Span(0, size),)}
        )
        plan = plan_reshard({name: layout}, {name: whole}, colocated=True)
        me = self._group.rank
        sources = {name: cast_once(shards[name], dtype)} if me in layout.holders else {}
        target = (
            {name: torch.empty(layout.shape, dtype=getattr(torch, dtype))} if self.sends else {}
        )
        execute_reshard(plan, me, sources, target, deadline, self._group)
        return target.get(name)

    def _check(
        self,
        shards: Mapping[str, torch.Tensor],
        buckets: Sequence[tuple[Unit, ...]],
        deadline: Deadline,
    ) -> None:
        """Raise GeometryMismatchError on every rank unless every rank's shards fit the
        layout and every rank planned the same buckets."""
        me, world = self._group.rank, self._group.world_size
        problems = self._shard_problems(shards)
        planned = fingerprint(buckets)
        flags = torch.zeros(world + 2, dtype=torch.int64)
        flags[me], flags[world], flags[world + 1] = int(bool(problems)), planned, -planned
        self._group.all_reduce(flags, deadline, op="max")
        if problems:
            raise GeometryMismatchError(
                f"rank {me}: shards do not fit {self._parallelism} ({len(problems)} problems): "
                + "; ".join(problems[:5])
            )
        bad = [rank for rank in range(world) if flags[rank]]
        if bad:
            raise GeometryMismatchError(f"ranks {bad} hold shards that do not fit the layout")
        if int(flags[world]) != -int(flags[world + 1]):
            raise GeometryMismatchError(
                "ranks planned different buckets: every rank needs the same config, dtypes, "
                "name map and bucket size"
            )

    def _shard_problems(self, shards: Mapping[str, torch.Tensor]) -> list[str]:
        me, dtype = self._group.rank, getattr(torch, self._params_dtype)
        problems = [f"unknown {name}" for name in shards if name not in self._layouts]
        for name, layout in self._layouts.items():
            tensor = shards.get(name)
            if me not in layout.holders:
                if tensor is not None:
                    problems.append(f"{name} is not this rank's")
                continue
            expected = layout.local_shape(me)
            if tensor is None:
                problems.append(f"missing {name}")
            elif tuple(tensor.shape) != expected or tensor.dtype != dtype:
                problems.append(
                    f"{name}: {tuple(tensor.shape)} {tensor.dtype}, expected {expected} {dtype}"
                )
        return problems
