"""Trainer rank 0 for engines that join refit's group through their own protocol.

Such engines (a Dynamo worker over vLLM's weight-transfer protocol, an SGLang engine) run no
refit endpoint: the trainer alone hosts the group and sends, and each backend says how it
plans and how it sends. :class:`PeerTrainer` is the part they share: the lock, the group and
the plan, joining, the transfer's preconditions, and the abort.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Generic, Protocol, TypeVar

from refit_core import RefitAbortedError
from refit_core.backend import CollectiveSenderSpec, Deadline, PolicyLike
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.child.process_group import make_group
from refit_nccl.group.devices import DeviceReport, DeviceType
from refit_nccl.group.spec import GroupSpec
from refit_nccl.roles.contract import CollectiveTrainerRole, JoinRequest, StateItems
from refit_nccl.transfer.stats import TransferStats

__all__ = ["PeerTrainer"]

logger = logging.getLogger(__name__)


class _Plan(Protocol):
    @property
    def digest(self) -> str: ...


PlanT = TypeVar("PlanT", bound=_Plan)


class PeerTrainer(ABC, CollectiveTrainerRole, Generic[PlanT]):
    """The sending trainer rank (rank 0) of a refit into engines of another protocol.

    Plays :class:`~refit_nccl.roles.contract.CollectiveTrainerRole` for refit-nccl's synchronizer
    (``refit_device``, ``refit_state``, ``refit_plan``, ``refit_join``, ``refit_transfer``,
    ``refit_abort``). Every group call runs under the
    remaining deadline, so this side never hangs.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
        device: where the policy's tensors live; None: this process's device.
    """

    engines = "this"
    """What the engines are, for errors (``"an SGLang"`` refit ...)."""

    def __init__(self, policy: PolicyLike, device: DeviceType | None = None) -> None:
        self._policy = policy
        self._device = device
        self._lock = threading.Lock()
        self._group: AbortableProcessGroup | None = None
        self._group_name: str | None = None
        self._plan: PlanT | None = None

    @abstractmethod
    def _build_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> PlanT:
        """The plan of ``state`` under ``geometry``."""

    @abstractmethod
    def _send(
        self, group: AbortableProcessGroup, plan: PlanT, version: int, deadline: Deadline
    ) -> TransferStats:
        """Broadcast the policy's current weights by ``plan``."""

    def _group_spec(self, request: JoinRequest) -> GroupSpec:
        """The group to host for ``request`` (the request's own, unless overridden)."""
        return request.group

    def refit_device(self) -> DeviceReport:
        """Where this trainer's tensors live and which backends it can join."""
        return DeviceReport.of(self._device)

    def refit_state(self) -> StateItems:
        """The state this trainer sends, in transfer order."""
        return tuple(self._policy.weight_source().state_dict_info().items())

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of the plan for ``state`` and ``geometry``; joins nothing."""
        return self._build_plan(state, geometry).digest

    def refit_join(self, request: JoinRequest) -> str:
        """Leave any previous group, host and join ``request.group``; the plan digest."""
        if request.group.rank != 0:
            raise ValueError(f"{self.engines} refit has one trainer rank, the sender (rank 0)")
        with self._lock:
            if self._group is not None:
                self._group.abort("joining a new group")
            self._group = self._group_name = self._plan = None
            plan = self._build_plan(request.state, request.geometry)
            group = make_group(self._group_spec(request))
            self._group, self._group_name = group, request.group.name
            group.connect(Deadline.from_wire(request.timeout_s))
            self._plan = plan
            logger.info("%s: joined as the sender of %s", request.group.label, request.group.name)
            return plan.digest

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Broadcast the policy's current weights to every engine."""
        with self._lock:
            group, plan = self._group, self._plan
            if group is None or plan is None:
                raise RefitAbortedError("not in a group: call refit_join first")
            return self._send(group, plan, version, Deadline.from_wire(timeout_s))

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Abort the current group (only if it is ``group_name``, when given); never blocks."""
        group = self._group
        if group is not None and group_name in (None, self._group_name):
            group.abort(cause)
