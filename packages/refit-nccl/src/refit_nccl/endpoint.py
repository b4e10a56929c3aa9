"""The participant side of a collective refit: what each trainer rank and engine worker runs.

An endpoint is a plain object playing a role of :mod:`refit_nccl.roles`, whose ``refit_*``
methods the controller calls, usually as a Ray actor (``ray.remote(EngineEndpoint).options(max_concurrency=2)``, so ``refit_abort`` is
served while a transfer blocks) or as a member of a framework's own worker that forwards
those methods. Every call that touches the group carries the remaining deadline, armed here,
inside the participant.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from refit_core import (
    GeometryMismatchError,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
    TensorSpec,
)
from refit_core.backend import CollectiveSenderSpec, Deadline, PolicyLike, notify
from refit_core.sources import ShardedWeightSource
from refit_nccl.broadcast import TransferStats, receive_packed, send_packed
from refit_nccl.child import make_group
from refit_nccl.devices import DeviceReport, DeviceType
from refit_nccl.geometry import DEFAULT_GEOMETRY
from refit_nccl.group import AbortableProcessGroup
from refit_nccl.handshake import agree_on_plan
from refit_nccl.plan import TransferPlan
from refit_nccl.roles import (
    CollectiveStagingRole,
    CollectiveTrainerRole,
    JoinRequest,
    StateItems,
)
from refit_nccl.storage import PlanStorage, StagingBuffers

__all__ = [
    "CollectiveEngine",
    "CommitStats",
    "EngineEndpoint",
    "EngineStatus",
    "TrainerEndpoint",
]

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


@dataclass(frozen=True)
class EngineStatus:
    """An engine worker's refit state.

    Attributes:
        committed_version: the version it serves (0: its initial weights).
        loaded_version: the version fully received and loaded but maybe not committed.
        dirty: a transfer failed part-way; the weights are mixed until the next full refit.
        connected: whether its group is usable.
        abort_cause: why its group was aborted, if it was.
        closed: its weights changed since the last commit: it serves nothing (its engine
            was told through ``on_refit_begin`` / ``on_refit_abort``) until a refit commits.
        staged_version: the version staged beside the engine, awaiting its commit.
        can_stage: whether it can stage a refit (:class:`~refit_nccl.roles.CollectiveStagingRole`).
        began_version: the highest version a transfer or staging ever began here (committed
            or not), so that a new controller never reuses it.
    """

    committed_version: int
    loaded_version: int | None
    dirty: bool
    connected: bool
    abort_cause: str | None
    closed: bool = False
    staged_version: int | None = None
    can_stage: bool = False
    began_version: int = 0


@dataclass(frozen=True)
class CommitStats:
    """What committing a staged refit did on one engine worker.

    Attributes:
        version: the version it serves now.
        paused_s: how long its engine was paused: from the return of ``on_refit_begin`` (the
            engine at a step boundary) to that of ``on_refit_commit``.
    """

    version: int
    paused_s: float


def _deadline(timeout_s: float | None, what: str) -> Deadline:
    """The participant's own deadline from what the controller said was left."""
    if timeout_s is not None and timeout_s <= 0:
        raise RefitTimeoutError(f"no time left for {what}")
    return Deadline.after(timeout_s)


class _Endpoint(ABC):
    """Group membership, plan and deadline handling shared by both roles.

    Args:
        device: where this participant's tensors live; None: this process's device (CUDA
            where it can use a GPU).
    """

    def __init__(self, device: DeviceType | None = None) -> None:
        self._lock = threading.Lock()
        self._group: AbortableProcessGroup | None = None
        self._plan: TransferPlan | None = None
        self._staging = StagingBuffers()
        self._device = device

    def refit_device(self) -> DeviceReport:
        """Where this participant's tensors live and which backends it can join (the
        controller chooses the group's backend from every member's report)."""
        return DeviceReport.of(self._device)

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """Check ``state`` and ``geometry`` against this participant and return the plan
        digest, without joining anything (the controller compares digests before any
        rendezvous, so a mismatch never leaves peers waiting in one).

        Raises:
            GeometryMismatchError: this participant cannot take part in such a transfer.
        """
        return self._plan_for(state, geometry).digest

    def refit_join(self, request: JoinRequest) -> str:
        """Leave any previous group, join ``request.group`` and agree on the plan.

        Returns the plan digest.

        Raises:
            GeometryMismatchError: this participant plans differently from the others.
            RefitTimeoutError: the rendezvous or the handshake passed the deadline.
        """
        with self._lock:
            self._leave("joining a new group")
            deadline = _deadline(request.timeout_s, "join")
            plan = self._plan_for(request.state, request.geometry)
            group = make_group(request.group)
            self._group = group
            group.connect(deadline)
            try:
                agree_on_plan(group, plan.digest, deadline)
            except RefitError as exc:
                group.abort(f"handshake failed: {exc}")
                raise
            self._plan = plan
            logger.info("%s: joined, plan %s", request.group.label, plan.digest[:16])
            return plan.digest

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Move one refit's weights through the group (the role decides the direction).

        A transfer that fails leaves its buffers to the calls it abandoned (they end by
        their own timeout): the next transfer packs into fresh ones.
        """
        with self._lock:
            group, plan = self._joined()
            try:
                return self._transfer(group, plan, version, _deadline(timeout_s, "transfer"))
            except BaseException:
                self._staging = StagingBuffers()
                raise

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Abort the current group (only if it is ``group_name``, when given); never blocks,
        so it is safe while a transfer runs."""
        group = self._group
        if group is not None and group_name in (None, group.spec.name):
            group.abort(cause)

    def _leave(self, cause: str) -> None:
        if self._group is not None:
            self._group.abort(cause)
        self._group = None
        self._plan = None

    def _joined(self) -> tuple[AbortableProcessGroup, TransferPlan]:
        group, plan = self._group, self._plan
        if group is None or plan is None:
            raise RefitAbortedError("not in a group: call refit_join first")
        return group, plan

    @abstractmethod
    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        """Check the transfer against this participant and plan it."""

    @abstractmethod
    def _transfer(
        self, group: AbortableProcessGroup, plan: TransferPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        """Run this participant's side of one transfer."""


class TrainerEndpoint(_Endpoint, CollectiveTrainerRole):
    """A trainer rank: rank 0 broadcasts the policy's weights, other trainer ranks receive
    and discard them (a broadcast needs every member).

    A sharded source (:class:`~refit_core.sources.ShardedWeightSource`) runs gathers on every
    trainer rank: only its sending rank joins the refit group, as rank 0, and every other
    rank drives ``iter_buckets()`` beside the refit; such a rank asking to join is refused.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
        device: where the policy's tensors live; None: this process's device.
    """

    def __init__(self, policy: PolicyLike, device: DeviceType | None = None) -> None:
        super().__init__(device)
        self._policy = policy

    def refit_join(self, request: JoinRequest) -> str:
        """See :meth:`_Endpoint.refit_join`; refuses a non-sending rank of a sharded source.

        Raises:
            GeometryMismatchError: this rank is not rank 0 and its source is sharded.
        """
        if request.group.rank and isinstance(self._policy.weight_source(), ShardedWeightSource):
            raise GeometryMismatchError(
                f"{request.group.label}: a sharded source gathers on every trainer rank, so only "
                "its sending rank joins the refit group; drive iter_buckets() on the others"
            )
        return super().refit_join(request)

    def refit_state(self) -> StateItems:
        """The state this trainer sends, in transfer order."""
        return tuple(self._policy.weight_source().state_dict_info().items())

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        # The state is trainer rank 0's own; the sender checks every tensor against the plan.
        return TransferPlan.build(dict(state), geometry)

    def _transfer(
        self, group: AbortableProcessGroup, plan: TransferPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        if group.rank == 0:
            source = self._policy.weight_source()
            tensors = ((item.name, item.tensor) for item in source.iter_tensors())
            stats = send_packed(group, plan, tensors, deadline, staging=self._staging)
            logger.info("%s: sent version %d in %.3f s", group.spec.label, version, stats.total_s)
            return stats
        return receive_packed(group, plan, lambda _: None, deadline, staging=self._staging)


class EngineEndpoint(_Endpoint, CollectiveStagingRole):
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
    """

    def __init__(
        self,
        engine_factory: Callable[[], CollectiveEngine],
        geometry: CollectiveSenderSpec = DEFAULT_GEOMETRY,
        device: DeviceType | None = None,
        *,
        can_stage: bool = True,
        versions: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(device)
        self._can_stage = can_stage
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
        """Abort the group (see :meth:`_Endpoint.refit_abort`); an engine that had loaded
        the whole refit, which failed elsewhere, is told too: it stays closed, its weights
        being a version nobody committed."""
        super().refit_abort(cause, group_name)
        loaded = self._loaded
        if loaded is not None and self._closed and not self._dirty:
            self._loaded = None
            notify(self.engine, "on_refit_abort", loaded, weights_changed=True)

    def refit_status(self) -> EngineStatus:
        """This worker's refit state."""
        group = self._group
        return EngineStatus(
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
            storage = self._staged
            if storage is None or storage.plan.digest != plan.digest:
                storage = self._staged = PlanStorage(plan, torch.device("cpu"))
            deadline = _deadline(timeout_s, "staging")
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

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            if not self._closed:
                notify(engine, "on_refit_begin", version)
                self._closed = True
            self._dirty = True
            engine.load_weights(items)

        try:
            stats = receive_packed(group, plan, load, deadline, staging=self._staging)
        except BaseException:
            if self._dirty:
                notify(engine, "on_refit_abort", version, weights_changed=True)
            raise
        self._loaded, self._dirty = version, False
        logger.info("%s: loaded version %d in %.3f s", group.spec.label, version, stats.total_s)
        return stats
