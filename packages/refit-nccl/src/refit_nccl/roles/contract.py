"""The roles of a collective refit: what the controller calls on each participant.

Every participant of :class:`~refit_nccl.CollectiveWeightSynchronizer` plays one of these
roles, whatever runs it (a Ray actor serving :class:`~refit_nccl.TrainerEndpoint` or
:class:`~refit_nccl.EngineEndpoint`, a framework's own worker forwarding the same methods, an
engine reached over HTTP or vLLM's RPC). The controller names these methods in its calls
(``participant.call(CollectiveEngineRole.refit_commit, version)``), so a renamed or
mistyped call is a type error.

This module is the contract alone (the roles, what they take and what they answer), so
anything may import it: it imports no other module of its folder, and nothing above
:mod:`refit_nccl.group` and :mod:`refit_nccl.transfer`, whose types it names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from refit_core import TensorSpec
from refit_core.backend import Participant

if TYPE_CHECKING:
    from refit_core.backend import CollectiveSenderSpec
    from refit_nccl.group.devices import DeviceReport
    from refit_nccl.group.spec import GroupSpec
    from refit_nccl.transfer.stats import TransferStats

__all__ = [
    "CollectiveEngineRole",
    "CollectiveMemberRole",
    "CollectiveStagingRole",
    "CollectiveTrainerRole",
    "CommitStats",
    "JoinRequest",
    "ShardMap",
    "StateItems",
    "WorkerRefitStatus",
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
        timeout_s: the refit's deadline in its wire form (``Deadline.to_wire``: the seconds
            left, None: disarmed).
    """

    group: GroupSpec
    state: StateItems
    geometry: CollectiveSenderSpec
    timeout_s: float | None


@dataclass(frozen=True)
class WorkerRefitStatus:
    """An engine worker's refit state, as it reports it (``refit_status()``); the
    controller turns these into :class:`refit_core.EngineStatus` entries of its fleet status.

    Attributes:
        committed_version: the version it serves (0: its initial weights).
        loaded_version: the version fully received and loaded but maybe not committed.
        dirty: a transfer failed part-way; the weights are mixed until the next full refit.
        connected: whether its group is usable.
        abort_cause: why its group was aborted, if it was.
        closed: its weights changed since the last commit: it serves nothing (its engine
            was told through ``on_refit_begin`` / ``on_refit_abort``) until a refit commits.
        staged_version: the version staged beside the engine, awaiting its commit.
        can_stage: whether it can stage a refit (:class:`CollectiveStagingRole`).
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

    def refit_status(self) -> WorkerRefitStatus:
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


ShardMap = Mapping[int, Sequence[Participant[CollectiveEngineRole]]]
"""Engine shard index -> its workers, in local-rank order, as the controller reaches them."""
