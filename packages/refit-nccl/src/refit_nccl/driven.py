"""Engine ranks that refit drives through the engine's own calls, as collective participants.

A Dynamo worker (its admin routes) and an unmodified vLLM engine (vLLM's weight-sync surface)
run no refit endpoint: one call reaches every rank of the engine, which joins the trainer's
group and receives by itself. Each engine rank is still one participant, so the synchronizer
plans ranks as usual; local rank 0 makes the engine's calls, each on a thread of its own, and
the other ranks answer at once. refit cannot abort the communicator inside such an engine:
an abort is only logged, and an engine that does not answer by the deadline is named wedged.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

from refit_core import CollectiveSenderSpec, GeometryMismatchError
from refit_core.participants import Participant
from refit_nccl.broadcast import TransferStats
from refit_nccl.devices import DeviceReport
from refit_nccl.endpoint import JoinRequest, StateItems
from refit_nccl.futures import dispatch, done, in_thread, then
from refit_nccl.plan import TransferPlan

__all__ = ["DrivenRankParticipant"]

logger = logging.getLogger(__name__)


class DrivenRankParticipant(Participant):
    """Rank ``local_rank`` of an engine that refit drives through the engine's own calls.

    Serves the engine calls of the collective synchronizer (``refit_device``,
    ``refit_geometry``, ``refit_plan``, ``refit_join``, ``refit_transfer``, ``refit_commit``,
    ``refit_abort``); a subclass says how the engine joins, updates and commits.

    Args:
        label: how errors name the engine (rank ``r > 0`` is ``label/rank{r}``).
        local_rank: this rank within the engine.
        geometry: the packing geometry the engine receives with.
    """

    engines = "an engine"
    """What the engine is, for messages."""

    def __init__(self, label: str, local_rank: int, geometry: CollectiveSenderSpec) -> None:
        super().__init__(label if local_rank == 0 else f"{label}/rank{local_rank}")
        self._local_rank = local_rank
        self._geometry = geometry
        self._plan: TransferPlan | None = None
        self._in_flight: Future[Any] | None = None

    @property
    def key(self) -> Hashable:
        """The engine and the rank within it."""
        return (self._engine_key(), self._local_rank)

    @property
    def drives(self) -> bool:
        """Whether this rank makes the engine's calls (local rank 0)."""
        return self._local_rank == 0

    def close(self) -> None:
        """Nothing to release: the engine's connections belong to whoever made them."""

    def call(self, method: str, *args: Any) -> Future[Any]:
        """Start ``method(*args)``; never blocks."""
        handlers: dict[str, Callable[..., Future[Any]]] = {
            "refit_device": lambda: done(self._device_report()),
            "refit_geometry": lambda: done(self._geometry),
            "refit_plan": lambda state, geometry: done(self._plan_for(state, geometry).digest),
            "refit_join": self._join,
            "refit_transfer": self._transfer,
            "refit_commit": self._commit,
            "refit_abort": self._abort,
        }
        return dispatch(handlers, method, args, self.engines)

    # -- what a subclass says ----------------------------------------------------------

    @abstractmethod
    def _engine_key(self) -> Hashable:
        """Identity of the engine: a restarted one has another key."""

    @abstractmethod
    def _device_report(self) -> DeviceReport:
        """Where the engine receives and which backends it can join."""

    @abstractmethod
    def _join_engine(self, request: JoinRequest) -> None:
        """Have the engine join ``request.group`` (blocks until it has)."""

    @abstractmethod
    def _update_engine(self, version: int) -> None:
        """Have the engine receive one transfer and finish its update (blocks until done)."""

    def _commit_engine(self, version: int) -> None:
        """After every engine finished: drop caches computed with older weights."""

    # -- the calls ---------------------------------------------------------------------

    def _plan_for(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        if geometry != self._geometry:
            raise GeometryMismatchError(
                f"{self.label}: receives with {self._geometry}, the plan uses {geometry}"
            )
        return TransferPlan.build(dict(state), geometry)

    def _join(self, request: JoinRequest) -> Future[str]:
        plan = self._plan = self._plan_for(request.state, request.geometry)
        if not self.drives:
            return done(plan.digest)
        self._in_flight = in_thread(self._join_engine, request, name=f"refit-{self.label}")
        return then(self._in_flight, lambda _: plan.digest)

    def _transfer(self, version: int, timeout_s: float | None) -> Future[TransferStats]:
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{self.label}: refit_transfer before refit_join")
        started = time.monotonic()
        sizes = (len(plan.buckets), plan.wire_bytes, plan.dense_bytes)
        if not self.drives:
            return done(TransferStats.since(started, *sizes))
        self._in_flight = in_thread(self._update_engine, version, name=f"refit-{self.label}")
        return then(self._in_flight, lambda _: TransferStats.since(started, *sizes))

    def _commit(self, version: int) -> Future[int]:
        if not self.drives:
            return done(version)
        committed = in_thread(self._commit_engine, version, name=f"refit-{self.label}")
        return then(committed, lambda _: version)

    def _abort(self, cause: str, *_: object) -> Future[None]:
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            logger.warning(
                "%s: its join or update is still running and refit cannot abort the "
                "communicator inside %s (%s); it may stay wedged until its weight transfer "
                "is re-initialized or it is restarted",
                self.label,
                self.engines,
                cause,
            )
        return done(None)
