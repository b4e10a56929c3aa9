"""``MegatronWeightSynchronizer``: one process's part of a reshard refit (SPMD).

Every process of the deployment (trainer ranks and, when not colocated, inference ranks)
builds one over the same plan and calls ``sync_weights`` together. A plan whose copies all
stay inside their process (matching colocated layouts) needs no group; otherwise the
processes meet in an :class:`~refit_nccl.AbortableProcessGroup` whose calls all run under
the refit's deadline. A failed refit leaves the group aborted: :meth:`is_stale` turns True
and ``reconcile_communicator`` rebuilds it over a fresh rendezvous.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from refit_core import RefitResult, WeightSynchronizer
from refit_core.backend import Deadline
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.devices import DeviceType
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Backend
from refit_nccl.megatron.executor import execute_reshard
from refit_nccl.megatron.plan import ReshardPlan

__all__ = ["MegatronWeightSynchronizer", "Rendezvous", "Shards"]

logger = logging.getLogger(__name__)

Shards = Callable[[], Mapping[str, torch.Tensor]]
"""Returns this process's shards by global parameter name (empty if it holds none)."""

Rendezvous = Callable[[], tuple[str, int]]
"""Returns the host and a fresh port of a group's store, the same on every process."""


class MegatronWeightSynchronizer(WeightSynchronizer):
    """Reshards the trainer's Megatron shards into the inference model's shards.

    Args:
        plan: the reshard plan, identical on every process.
        process: this process's rank in the plan (:meth:`ReshardPlan.process_of_source` /
            ``process_of_destination``).
        sources: this process's trainer shards.
        destinations: this process's inference shards, written in place.
        rendezvous: where the group meets, called again for each rebuild; may be None
            when :attr:`needs_group` is False.
        backend: the group's backend; None: the processes agree on it when the group connects,
            each reporting the device of its shards (NCCL when all are on CUDA, gloo when all
            are on CPU, mixed devices refused on every process).
        refit_timeout_s: deadline of one refit (None disarms it).
    """

    def __init__(
        self,
        plan: ReshardPlan,
        process: int,
        sources: Shards,
        destinations: Shards,
        rendezvous: Rendezvous | None,
        *,
        backend: Backend | None = None,
        refit_timeout_s: float | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        if not 0 <= process < plan.world_size:
            raise ValueError(f"process {process} is not in a plan of {plan.world_size}")
        if rendezvous is None and plan.sent_bytes:
            raise ValueError("the plan copies between processes: a rendezvous is needed")
        self.plan = plan
        self.process = process
        self._sources = sources
        self._destinations = destinations
        self._rendezvous = rendezvous
        self._backend = backend
        self._group: AbortableProcessGroup | None = None

    @property
    def needs_group(self) -> bool:
        """Whether any copy of the plan crosses between processes."""
        return self.plan.sent_bytes > 0

    def _init_communicator(self, deadline: Deadline) -> None:
        if self._rendezvous is None or not self.needs_group:
            logger.info("megatron reshard: layouts keep every copy in-process, no group")
            return
        host, port = self._rendezvous()
        spec = GroupSpec(
            host,
            port,
            self.process,
            self.plan.world_size,
            self._backend,
            name="refit-megatron",
            device=self._shard_device(),
        )
        group = AbortableProcessGroup(spec)
        group.connect(deadline)
        self._group = group

    def _shard_device(self) -> DeviceType | None:
        """The device type of this process's shards (None when it holds none)."""
        for shards in (self._sources(), self._destinations()):
            for tensor in shards.values():
                return "cuda" if tensor.is_cuda else "cpu"
        return None

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        started = time.monotonic()
        stats = execute_reshard(
            self.plan, self.process, self._sources(), self._destinations(), deadline, self._group
        )
        total = time.monotonic() - started
        dense = sum(layout.nbytes for layout in self.plan.destinations.values())
        return RefitResult(
            version=version,
            timings_s={"reshard": total},
            total_s=total,
            wire_bytes=stats.sent_bytes,
            dense_bytes=dense,
        )

    def _is_stale(self) -> bool:
        return self._group is not None and self._group.aborted

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        if absent_shards:
            raise NotImplementedError(
                f"a reshard plan has fixed layouts; cannot drop shards {sorted(absent_shards)}"
            )
        if self._is_stale():
            self._group = None
            self._init_communicator(deadline)

    def _shutdown(self) -> None:
        if self._group is not None:
            self._group.abort("shut down")
            self._group = None
