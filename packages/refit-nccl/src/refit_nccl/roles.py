"""The roles of a collective refit: what the controller calls on each participant.

Every participant of :class:`~refit_nccl.CollectiveWeightSynchronizer` plays one of these
roles, whatever runs it (a Ray actor serving :class:`~refit_nccl.TrainerEndpoint` or
:class:`~refit_nccl.EngineEndpoint`, a framework's own worker forwarding the same methods, an
engine reached over HTTP or vLLM's RPC). The controller names these methods in its calls
(``participant.call(CollectiveEngineRole.refit_commit, version)``), so a renamed or
mistyped call is a type error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from refit_core import TensorSpec

if TYPE_CHECKING:
    from refit_core.backend import CollectiveSenderSpec
    from refit_nccl.broadcast import TransferStats
    from refit_nccl.devices import DeviceReport
    from refit_nccl.endpoint import CommitStats, EngineStatus
    from refit_nccl.group import GroupSpec

__all__ = [
    "CollectiveEngineRole",
    "CollectiveMemberRole",
    "CollectiveStagingRole",
    "CollectiveTrainerRole",
    "JoinRequest",
    "StateItems",
]

StateItems = tuple[tuple[str, TensorSpec], ...]
"""A state's ``(name, spec)`` pairs in transfer order (picklable, ordered)."""


@dataclass(frozen=True)
class JoinRequest:
    """Everything a participant needs to join one group and plan its transfers.

    Attributes:
        group: this participant's place in the group.
        state: the trainer's state, in transfer order.
        geometry: the packing geometry the engines declared.
        timeout_s: what is left of the deadline (None: disarmed).
    """

    group: GroupSpec
    state: StateItems
    geometry: CollectiveSenderSpec
    timeout_s: float | None


class CollectiveMemberRole(Protocol):
    """What every member of a refit group serves, trainer rank or engine worker."""

    def refit_device(self) -> DeviceReport:
        """Where this member sends or receives, and which backends it can join."""
        ...

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of this member's plan for ``state`` under ``geometry``; joins nothing.

        Raises:
            GeometryMismatchError: this member cannot take part in such a transfer.
        """
        ...

    def refit_join(self, request: JoinRequest) -> str:
        """Leave any previous group, join ``request.group`` and agree on the plan; the plan
        digest."""
        ...

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Move one refit's weights through the group within ``timeout_s`` seconds."""
        ...

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Abort the current group (only if it is ``group_name``, when given); never blocks."""
        ...


class CollectiveTrainerRole(CollectiveMemberRole, Protocol):
    """A trainer rank (rank 0 sends)."""

    def refit_state(self) -> StateItems:
        """The state this trainer sends, in transfer order."""
        ...


class CollectiveEngineRole(CollectiveMemberRole, Protocol):
    """An engine worker: declares its geometry, receives, and commits on request."""

    def refit_geometry(self) -> CollectiveSenderSpec:
        """The packing geometry this receiver declares."""
        ...

    def refit_commit(self, version: int) -> int:
        """Serve ``version``, fully received by the last transfer; returns it."""
        ...

    def refit_status(self) -> EngineStatus:
        """This worker's refit state (the fleet status and a failure's engine reports)."""
        ...


class CollectiveStagingRole(CollectiveEngineRole, Protocol):
    """An engine worker that can stage a refit beside the weights it serves (two-phase).

    It says so in its status (``refit_status().can_stage``); the controller asks before it
    stages, so an engine role without these methods is refused by name, never half-staged.
    """

    def refit_stage(self, version: int, timeout_s: float | None) -> TransferStats:
        """Receive one refit's weights into a staging copy beside the engine within
        ``timeout_s`` seconds; the engine's weights are untouched and it is never paused."""
        ...

    def refit_commit_staged(self, version: int) -> CommitStats:
        """Serve the staged ``version``: pause the engine at its next step boundary, load
        the staged copy, drop its prefix cache, set the version, resume."""
        ...

    def refit_drop_staged(self, version: int) -> None:
        """Forget the staged ``version`` (nothing happens to the engine)."""
        ...
