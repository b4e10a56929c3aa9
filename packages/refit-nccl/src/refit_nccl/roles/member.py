"""What every endpoint of a collective refit does, trainer rank or engine worker: join a
group and agree on the plan, run its side of a transfer under the deadline it was given, and
abort (:class:`MemberEndpoint`).

An endpoint is a plain object playing a role of :mod:`refit_nccl.roles.contract`, whose
``refit_*`` methods the controller calls, usually as a Ray actor
(``ray.remote(EngineEndpoint).options(max_concurrency=2)``, so ``refit_abort`` is served while a
transfer blocks) or as a member of a framework's own worker that forwards those methods. Every
call that touches the group carries the remaining deadline, armed here, inside the participant.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from refit_core import RefitAbortedError, RefitError, RefitTimeoutError
from refit_core.backend import CollectiveSenderSpec, Deadline
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.child.process_group import make_group
from refit_nccl.group.devices import DeviceReport, DeviceType
from refit_nccl.roles.contract import JoinRequest, StateItems
from refit_nccl.transfer.handshake import agree_on_plan
from refit_nccl.transfer.plan import TransferPlan
from refit_nccl.transfer.stats import TransferStats
from refit_nccl.transfer.storage import StagingBuffers

__all__ = ["MemberEndpoint", "participant_deadline"]

logger = logging.getLogger(__name__)


def participant_deadline(timeout_s: float | None, what: str) -> Deadline:
    """The participant's own deadline from the controller's (``timeout_s``: its wire form,
    :meth:`Deadline.to_wire`).

    Raises:
        RefitTimeoutError: nothing is left for ``what``.
        ProtocolError: ``timeout_s`` is no wire deadline.
    """
    deadline = Deadline.from_wire(timeout_s)
    if deadline.expired():
        raise RefitTimeoutError(f"no time left for {what}")
    return deadline


class MemberEndpoint(ABC):
    """Group membership, plan and deadline handling shared by the trainer and engine endpoints.

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
            deadline = participant_deadline(request.timeout_s, "join")
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
                return self._transfer(
                    group, plan, version, participant_deadline(timeout_s, "transfer")
                )
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
