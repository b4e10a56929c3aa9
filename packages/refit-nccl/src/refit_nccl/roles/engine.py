"""An engine worker's endpoint (:class:`EngineEndpoint`): receives every bucket into its
engine (:class:`CollectiveEngine`) and commits on request, or stages a refit beside it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch

from refit_core import GeometryMismatchError, RefitError, TensorSpec
from refit_core.backend import CollectiveSenderSpec, Deadline, notify
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.devices import DeviceType
from refit_nccl.roles.contract import (
    CollectiveStagingRole,
    CommitStats,
    StateItems,
    WorkerRefitStatus,
)
from refit_nccl.roles.member import MemberEndpoint, participant_deadline
from refit_nccl.transfer.broadcast import receive_packed
from refit_nccl.transfer.geometry import DEFAULT_GEOMETRY
from refit_nccl.transfer.plan import TransferPlan
from refit_nccl.transfer.stats import TransferStats
from refit_nccl.transfer.storage import PlanStorage

__all__ = ["CollectiveEngine", "EngineEndpoint"]

logger = logging.getLogger(__name__)


@runtime_checkable
class CollectiveEngine(Protocol):
    """The engine calls an :class:`EngineEndpoint` makes (``ReferenceEngine`` fits)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Copy checkpoint-named tensors into the model; they are only valid during the call."""
        ...

    def reset_prefix_cache(self) -> object:
        """Drop every prefix/KV computed with older weights."""
        ...

    def set_weight_version(self, version: int) -> object:
        """Commit the version of the loaded weights."""
        ...

    def checkpoint_tensor_specs(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """Checkpoint name -> ``(shape, dtype name)`` the engine accepts."""
        ...


class EngineEndpoint(MemberEndpoint, CollectiveStagingRole):
    """An engine worker: receives every bucket into ``engine.load_weights``, commits on request.

    It also stages: ``refit_stage`` receives the whole refit into a host copy laid out by the
    plan (one host copy of the checkpoint, allocated at the first staging and reused), and
    ``refit_commit_staged`` writes it into the engine in one pause.

    Args:
        engine_factory: builds (or returns) the engine, on first use.
        geometry: the packing geometry this receiver declares.
        device: where the engine's weights live; None: this process's device.
        can_stage: whether it offers ``refit_stage`` (an engine that must write its
            weights its own way, as vLLM's layerwise reload, says False).
        versions: the versions it starts from, as ``(committed, began)`` (a receiver that
            replaces its endpoint keeps them; default: nothing yet, version 0).
        keeps_received: the engine keeps what ``load_weights`` hands it until the transfer
            ends (vLLM's staged receiver): on a host group every bucket is then received
            straight into storage laid out by the plan (kept for the next transfer), so the
            engine may keep those views without a copy (:attr:`receives_in_place`).
    """

    def __init__(
        self,
        engine_factory: Callable[[], CollectiveEngine],
        geometry: CollectiveSenderSpec = DEFAULT_GEOMETRY,
        device: DeviceType | None = None,
        *,
        can_stage: bool = True,
        versions: tuple[int, int] = (0, 0),
        keeps_received: bool = False,
    ) -> None:
        super().__init__(device)
        self._can_stage = can_stage
        self._keeps_received = keeps_received
        self._in_place = False
        self._engine_factory = engine_factory
        self._engine: CollectiveEngine | None = None
        self._geometry = geometry
        self._committed, self._began = versions
        self._loaded: int | None = None
        self._dirty = False
        self._closed = False
        self._staged: PlanStorage | None = None
        self._staged_version: int | None = None

    @property
    def engine(self) -> CollectiveEngine:
        """The engine (built on first use)."""
        if self._engine is None:
            self._engine = self._engine_factory()
        return self._engine

    @property
    def receives_in_place(self) -> bool:
        """Whether the transfer running now receives into storage laid out by its plan: the
        tensors ``load_weights`` is handed are views of it, valid until the next transfer."""
        return self._in_place

    def _plan_storage(self, plan: TransferPlan) -> PlanStorage:
        """Host storage laid out by ``plan`` (the last one, if it was laid out by the same
        plan)."""
        if self._staged is None or self._staged.plan.digest != plan.digest:
            self._staged = None  # the old copy is freed before the new one is allocated
            self._staged = PlanStorage(plan, torch.device("cpu"))
        return self._staged

    def refit_geometry(self) -> CollectiveSenderSpec:
        """The packing geometry this receiver declares."""
        return self._geometry

    def refit_commit(self, version: int) -> int:
        """Serve ``version``: drop stale prefix caches, then commit the version.

        Raises:
            RefitError: ``version`` was not fully loaded by the last transfer.
        """
        with self._lock:
            if self._loaded != version or self._dirty:
                raise RefitError(
                    f"cannot commit version {version}: loaded {self._loaded}, dirty {self._dirty}"
                )
            self.engine.reset_prefix_cache()
            self.engine.set_weight_version(version)
            self._committed = version
            self._closed = False
            notify(self.engine, "on_refit_commit", version)
            return version

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Abort the group (see :meth:`MemberEndpoint.refit_abort`); an engine that had loaded
        the whole refit, which failed elsewhere, is told too: it stays closed, its weights
        being a version nobody committed."""
        super().refit_abort(cause, group_name)
        loaded = self._loaded
        if loaded is not None and self._closed and not self._dirty:
            self._loaded = None
            notify(self.engine, "on_refit_abort", loaded, weights_changed=True)

    def refit_status(self) -> WorkerRefitStatus:
        """This worker's refit state."""
        group = self._group
        return WorkerRefitStatus(
            self._committed,
            self._loaded,
            self._dirty,
            group is not None and group.connected,
            group.abort_cause if group is not None else None,
            self._closed,
            self._staged_version,
            can_stage=self._can_stage,
            began_version=self._began,
        )

    def refit_stage(self, version: int, timeout_s: float | None) -> TransferStats:
        """Receive ``version`` whole into the host staging copy; the engine's weights and its
        serving are untouched (no hook is called). A failure leaves nothing staged.

        Raises:
            NotImplementedError: this endpoint was built with ``can_stage=False``.
            RefitTimeoutError: a broadcast did not complete by the deadline or a peer failed.
        """
        if not self._can_stage:
            raise NotImplementedError(f"{type(self).__name__} was built with can_stage=False")
        with self._lock:
            group, plan = self._joined()
            self._staged_version = None
            self._began = max(self._began, version)
            storage = self._plan_storage(plan)
            deadline = participant_deadline(timeout_s, "staging")
            if group.device.type == "cpu":
                stats = receive_packed(group, plan, lambda _: None, deadline, into=storage)
            else:
                host = storage.tensors()

                def keep(items: list[tuple[str, torch.Tensor]]) -> None:
                    for name, tensor in items:
                        host[name].copy_(tensor)

                stats = receive_packed(group, plan, keep, deadline, staging=self._staging)
            self._staged_version = version
            logger.info("%s: staged version %d in %.3f s", group.spec.label, version, stats.total_s)
            return stats

    def refit_commit_staged(self, version: int) -> CommitStats:
        """Serve the staged ``version``: ``on_refit_begin`` (the engine pauses at its next
        step boundary, requests kept), load the staged copy, reset the prefix cache, set the
        version, ``on_refit_commit``. An engine whose load fails is closed and told
        (``on_refit_abort(weights_changed=True)``).

        Raises:
            RefitError: ``version`` is not staged here.
        """
        with self._lock:
            storage = self._staged
            if storage is None or self._staged_version != version:
                raise RefitError(f"cannot commit version {version}: staged {self._staged_version}")
            engine = self.engine
            notify(engine, "on_refit_begin", version)
            paused = time.perf_counter()
            self._closed = self._dirty = True
            self._staged_version = self._loaded = None
            try:
                engine.load_weights(storage.tensors().items())
                engine.reset_prefix_cache()
                engine.set_weight_version(version)
            except BaseException:
                notify(engine, "on_refit_abort", version, weights_changed=True)
                raise
            self._committed = self._loaded = version
            self._closed = self._dirty = False
            notify(engine, "on_refit_commit", version)
            return CommitStats(version, time.perf_counter() - paused)

    def refit_drop_staged(self, version: int) -> None:
        """Forget the staged ``version`` (its host copy is kept for the next staging)."""
        with self._lock:
            if self._staged_version == version:
                self._staged_version = None

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        if geometry != self._geometry:
            raise GeometryMismatchError(
                f"this receiver declared {self._geometry}, the plan uses {geometry}"
            )
        expected = {
            name: TensorSpec(tuple(shape), dtype)
            for name, (shape, dtype) in self.engine.checkpoint_tensor_specs().items()
        }
        offered = dict(state)
        problems = sorted(
            [f"missing {n}" for n in expected.keys() - offered.keys()]
            + [f"unexpected {n}" for n in offered.keys() - expected.keys()]
            + [
                f"{n}: sent {offered[n]}, expected {spec}"
                for n, spec in expected.items()
                if n in offered and offered[n] != spec
            ]
        )
        if problems:
            shown = "; ".join(problems[:5])
            raise GeometryMismatchError(
                f"the trainer's state does not fit this engine ({len(problems)} problems): {shown}"
            )
        return TransferPlan.build(offered, geometry)

    def _transfer(
        self, group: AbortableProcessGroup, plan: TransferPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        engine = self.engine
        self._loaded = None
        self._began = max(self._began, version)
        in_place = self._keeps_received and group.device.type == "cpu"
        into = self._plan_storage(plan) if in_place else None
        self._in_place = in_place

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            if not self._closed:
                notify(engine, "on_refit_begin", version)
                self._closed = True
            self._dirty = True
            engine.load_weights(items)

        try:
            stats = receive_packed(group, plan, load, deadline, staging=self._staging, into=into)
        except BaseException:
            if into is not None:
                self._staged = None  # calls it abandoned may still write it until they end
            if self._dirty:
                notify(engine, "on_refit_abort", version, weights_changed=True)
            raise
        self._loaded, self._dirty = version, False
        logger.info("%s: loaded version %d in %.3f s", group.spec.label, version, stats.total_s)
        return stats
