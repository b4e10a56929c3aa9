"""SGLang engines as the engine side of refit-nccl's :class:`CollectiveWeightSynchronizer`.

Each tensor-parallel rank of each engine is one participant playing refit-nccl's
:class:`~refit_nccl.CollectiveEngineRole`, so the synchronizer plans ranks as usual. One
SGLang call drives all of an engine's ranks (SGLang joins rank ``rank_offset + tp_rank``
itself), so local rank 0 makes the calls (each call runs on a thread of its own) and the other
ranks answer at once. A refit on rank 0 is: pause generation, one
``update_weights_from_distributed`` per bucket (received while the trainer broadcasts it),
flush the cache, and continue generation in a ``finally``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from refit_core import GeometryMismatchError, WorkerError
from refit_core.backend import (
    CollectiveSenderSpec,
    Deadline,
    InFlight,
    LocalParticipant,
    Participant,
    in_thread,
    method_name,
)
from refit_nccl import CollectiveEngineRole, WorkerRefitStatus
from refit_nccl.backend import DeviceReport, JoinRequest, TransferStats
from refit_sglang.client import SGLangClient
from refit_sglang.lifecycle import LIFECYCLE_ROUTES, PauseMode, flush_caches, paused
from refit_sglang.plan import DistributedPlan, StateItems, sglang_geometry

__all__ = ["EngineSettings", "SGLangRankEndpoint", "SGLangRankParticipant", "sglang_shards"]

logger = logging.getLogger(__name__)

_THREAD = "refit-sglang"
_ABORT = method_name(CollectiveEngineRole.refit_abort)
_LEAVE_WAIT_S = 5.0
"""How long shutdown waits for an engine to answer ``destroy_weights_update_group``."""
ROUTES = (
    *LIFECYCLE_ROUTES,
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
)
"""Every route the disaggregated row calls."""


@dataclass(frozen=True)
class EngineSettings:
    """How every engine of a disaggregated refit is driven.

    Attributes:
        bucket_size_bytes: most bytes named by one ``update_weights_from_distributed`` call.
        pause_mode: how generation pauses around a refit.
        control_timeout_s: bound of every SGLang call; it must outlast the refit deadline so
            an engine stuck in the collective is reported as wedged, not as failed.
    """

    bucket_size_bytes: int
    pause_mode: PauseMode
    control_timeout_s: float


class SGLangRankEndpoint(CollectiveEngineRole):
    """Tensor-parallel rank ``local_rank`` of the SGLang engine behind ``client``, playing the
    engine role (each call blocks; :class:`SGLangRankParticipant` runs it on a thread)."""

    def __init__(self, client: SGLangClient, local_rank: int, settings: EngineSettings) -> None:
        self.label = client.label if local_rank == 0 else f"{client.label}/rank{local_rank}"
        self._client = client
        self._local_rank = local_rank
        self._settings = settings
        self._geometry = sglang_geometry(settings.bucket_size_bytes)
        self._plan: DistributedPlan | None = None
        self._group_name: str | None = None
        self._in_flight = InFlight()
        self._leaving: Future[None] | None = None

    def close(self) -> None:
        """Wait (bounded) for a pending ``destroy_weights_update_group`` to answer, so the
        client can be closed after it (the client itself belongs to the synchronizer)."""
        leaving = self._leaving
        if leaving is None:
            return
        try:
            leaving.result(timeout=_LEAVE_WAIT_S)
        except Exception as exc:
            logger.warning("%s: leaving the weight-update group failed: %s", self.label, exc)

    def refit_device(self) -> DeviceReport:
        """The engine's device (its server args); SGLang joins a group of the backend the
        init call names, so a CUDA engine can take NCCL or gloo."""
        device = self._client.device
        if device == "cuda":
            return DeviceReport.of("cuda")
        if device == "cpu":
            return DeviceReport.of("cpu")
        raise WorkerError(
            f"device {device!r}: refit's collective moves CPU or CUDA tensors",
            worker=self.label,
            operation="refit_device",
        )

    def refit_geometry(self) -> CollectiveSenderSpec:
        """The geometry SGLang receives with."""
        return self._geometry

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of the plan for ``state``."""
        return self._plan_for(state, geometry).digest

    def refit_commit(self, version: int) -> int:
        """Nothing to do: the last bucket carried the version and the cache was flushed."""
        return version

    def refit_status(self) -> WorkerRefitStatus:
        """Not known here: SGLang reports no refit state of its own.

        Raises:
            NotImplementedError: always (the fleet status names the engine unreachable).
        """
        raise NotImplementedError("an SGLang engine has no refit_status")

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> DistributedPlan:
        if geometry != self._geometry:
            raise GeometryMismatchError(
                f"{self.label}: receives with {self._geometry}, the plan uses {geometry}"
            )
        return DistributedPlan.build(state, geometry)

    def refit_join(self, request: JoinRequest) -> str:
        """Join the group (local rank 0 asks the engine to); the plan digest."""
        plan = self._plan = self._plan_for(request.state, request.geometry)
        if self._local_rank != 0:
            return plan.digest
        group = request.group
        self._group_name = group.name
        body = {
            "master_address": group.host,
            "master_port": group.port,
            "rank_offset": group.rank,
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend,
        }
        with self._in_flight:
            self._enter(body)
        return plan.digest

    def _enter(self, body: dict[str, object]) -> None:
        """Join a new group once the destroy of the previous one has answered (or failed)."""
        leaving = self._leaving
        if leaving is not None:
            try:
                leaving.result(timeout=self._settings.control_timeout_s)
            except Exception as exc:
                logger.warning("%s: destroying the previous group failed: %s", self.label, exc)
        self._sglang("init_weights_update_group", body)

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Receive one refit (local rank 0 drives the engine); the engine's own calls are
        bounded by the control timeout, which outlasts ``timeout_s``."""
        plan, name = self._plan, self._group_name
        if plan is None:
            raise RuntimeError(f"{self.label}: refit_transfer before refit_join")
        started = time.monotonic()
        sizes = (len(plan.buckets), plan.dense_bytes, plan.dense_bytes)
        if self._local_rank == 0 and name is not None:
            with self._in_flight:
                self._refit(plan, name, version)
        return TransferStats.since(started, *sizes)

    def _refit(self, plan: DistributedPlan, group_name: str, version: int) -> None:
        """Pause, receive every bucket, flush, and continue generation, unless the engine
        may hold part of the new weights (then it stays paused: closed)."""
        never = Deadline.never()
        settings = self._settings
        with paused(
            [self._client], settings.pause_mode, never, settings.control_timeout_s
        ) as closed:
            try:
                self._receive(plan, group_name, version)
            except Exception:
                # SGLang loads a bucket tensor by tensor: after a failed or unanswered
                # update the engine may hold mixed weights, so it stays paused (closed).
                closed.add(self._client)
                raise
            flush_caches([self._client], never, settings.control_timeout_s)

    def _receive(self, plan: DistributedPlan, group_name: str, version: int) -> None:
        """One ``update_weights_from_distributed`` per bucket; the last carries ``version``."""
        for index, bucket in enumerate(plan.buckets):
            body: dict[str, object] = {
                "names": [n for n, _ in bucket],
                "dtypes": [s.dtype for _, s in bucket],
                "shapes": [list(s.shape) for _, s in bucket],
                "group_name": group_name,
                "flush_cache": False,
            }
            if index == len(plan.buckets) - 1:
                body["weight_version"] = str(version)
            self._sglang("update_weights_from_distributed", body)

    def _sglang(self, route: str, body: dict[str, object]) -> None:
        self._client.call(route, body, self._settings.control_timeout_s)

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Destroy the engine's group (only if it is ``group_name``, when given) when it is
        idle; an engine inside the collective cannot be aborted by refit and is reported as
        possibly wedged."""
        name = self._group_name
        if self._local_rank != 0 or name is None or group_name not in (None, name):
            return
        if self._in_flight:
            logger.warning(
                "%s: still inside the weight-update group and refit cannot abort the group "
                "inside an SGLang process (%s); the engine may stay wedged until it is "
                "restarted",
                self.label,
                cause,
            )
            return
        self._group_name = None
        self._leaving = in_thread(
            self._sglang, "destroy_weights_update_group", {"group_name": name}, name=_THREAD
        )


class SGLangRankParticipant(LocalParticipant[CollectiveEngineRole]):
    """An :class:`SGLangRankEndpoint` as the controller reaches it (each call on a thread)."""

    def __init__(self, client: SGLangClient, local_rank: int, settings: EngineSettings) -> None:
        self._rank = SGLangRankEndpoint(client, local_rank, settings)
        self._aborts: list[Future[Any]] = []
        super().__init__(self._rank, self._rank.label, key=(id(client), local_rank))

    def _start(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        started = super()._start(name, args, kwargs)
        if name == _ABORT:
            self._aborts = [f for f in self._aborts if not f.done()] + [started]
        return started

    def close(self) -> None:
        """Stop taking calls, let the aborts already asked for start their group destroy, then
        wait (bounded) for that destroy to answer, so the client can be closed after it."""
        super().close()
        concurrent.futures.wait(self._aborts, timeout=_LEAVE_WAIT_S)
        self._rank.close()


def sglang_shards(
    clients: Sequence[SGLangClient], settings: EngineSettings
) -> dict[int, list[Participant[CollectiveEngineRole]]]:
    """Shard index -> one participant per tensor-parallel rank of each engine.

    Raises:
        UnsupportedEngineError: an in-process engine that lacks a route or field refit needs.
    """
    for client in clients:
        client.require(ROUTES)
    return {
        index: [SGLangRankParticipant(client, rank, settings) for rank in range(client.tp_size)]
        for index, client in enumerate(clients)
    }
