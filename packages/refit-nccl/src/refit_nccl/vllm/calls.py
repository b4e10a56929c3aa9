"""The calls the controller makes into a refit-nccl vLLM worker, as typed call objects.

Each call is a frozen dataclass whose ``run`` calls :class:`VllmWorkerRole` (what the worker
extension does for the controller) by its typed method; the worker runs whatever it is sent
through one dispatcher (:func:`refit_core.backend.answer`), and calls and replies travel as
pickled bytes (:mod:`refit_core.worker_calls` says why). The synchronizer calls the engine
role (:class:`~refit_nccl.roles.contract.CollectiveStagingRole`); :func:`engine_call` turns such
a call into this module's call of the same operation. Each call also says how the controller
runs it: whether it writes the model or pauses the engine, whether it stages beside the
engine (polled with :class:`Staging`), the bound of its RPC, and the version a success serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from refit_core.backend import WorkerCall, method_name
from refit_nccl.roles.contract import (
    CollectiveEngineRole,
    CollectiveMemberRole,
    CollectiveStagingRole,
    CommitStats,
    JoinRequest,
    StateItems,
    WorkerRefitStatus,
)

if TYPE_CHECKING:
    from refit_core.backend import CollectiveSenderSpec
    from refit_nccl.group.devices import DeviceReport
    from refit_nccl.transfer.stats import TransferStats

__all__ = [
    "Abort",
    "Commit",
    "CommitStaged",
    "Device",
    "DropStaged",
    "EngineCall",
    "Geometry",
    "Join",
    "Plan",
    "Stage",
    "Staging",
    "Status",
    "Transfer",
    "VllmWorkerRole",
    "engine_call",
]

_R = TypeVar("_R")


class VllmWorkerRole(Protocol):
    """What a refit-nccl worker in a vLLM engine does for the controller: its endpoint's
    group calls, and the model-writing calls run inside vLLM's update session."""

    @property
    def endpoint(self) -> CollectiveEngineRole:
        """The worker's endpoint in the refit group."""
        ...

    def transfer(self, version: int, timeout_s: float | None) -> TransferStats | None:
        """Receive ``version``: into the model (its stats), or, on a staged receiver, into
        host memory on a thread of its own (None at once: :meth:`staging` says when it
        ended)."""
        ...

    def stage(self, version: int, timeout_s: float | None) -> None:
        """Start staging ``version`` beside the model; returns at once."""
        ...

    def staging(self) -> TransferStats | None:
        """The running staging's stats once it ended (None while it runs); raises its error."""
        ...

    def commit(self, version: int) -> int:
        """Serve ``version`` (a staged receiver loads it first); returns it."""
        ...

    def commit_staged(self, version: int) -> CommitStats:
        """Load the staged ``version`` into the model and serve it."""
        ...

    def drop_staged(self) -> None:
        """Forget what was staged; a staging still running is aborted."""
        ...

    def status(self) -> WorkerRefitStatus:
        """The worker's refit state."""
        ...


class EngineCall(WorkerCall[VllmWorkerRole, _R]):
    """A call into a refit-nccl vLLM worker, and how the controller runs it."""

    operation: ClassVar[str]
    """The engine role's method this call carries out (how errors name it)."""
    writes: ClassVar[bool] = False
    """Whether it writes the model (a failure settles the engine: reopened or closed)."""

    def pauses(self, staged: bool) -> bool:
        """Whether the engine is closed while it runs (``staged``: the receivers stage)."""
        return False

    def stages(self, staged: bool) -> bool:
        """Whether it starts a staging the controller polls (:class:`Staging`)."""
        return False

    def rpc_timeout_s(self, control_timeout_s: float, grace_s: float) -> float | None:
        """The bound of its RPC: its own deadline plus grace (None: disarmed), else the
        control timeout."""
        return control_timeout_s

    def served(self, result: _R) -> int | None:
        """The version a success serves (the engine reopens on it), if it commits."""
        return None

    def timed(self, result: _R, paused_s: float) -> _R:
        """The result, given how long the engine was paused for the call."""
        return result


def _plus_grace(timeout_s: float | None, grace_s: float) -> float | None:
    return None if timeout_s is None else timeout_s + grace_s


@dataclass(frozen=True)
class Device(EngineCall["DeviceReport"]):
    """Where the worker receives, and which backends it can join."""

    operation = method_name(CollectiveMemberRole.refit_device)

    def run(self, target: VllmWorkerRole) -> DeviceReport:
        return target.endpoint.refit_device()


@dataclass(frozen=True)
class Plan(EngineCall[str]):
    """The digest of the worker's plan for ``state`` under ``geometry``."""

    operation = method_name(CollectiveMemberRole.refit_plan)
    state: StateItems
    geometry: CollectiveSenderSpec

    def run(self, target: VllmWorkerRole) -> str:
        return target.endpoint.refit_plan(self.state, self.geometry)


@dataclass(frozen=True)
class Join(EngineCall[str]):
    """Join ``request.group`` and agree on the plan; the plan digest."""

    operation = method_name(CollectiveMemberRole.refit_join)
    request: JoinRequest

    def run(self, target: VllmWorkerRole) -> str:
        return target.endpoint.refit_join(self.request)

    def rpc_timeout_s(self, control_timeout_s: float, grace_s: float) -> float | None:
        return _plus_grace(self.request.timeout_s, grace_s)


@dataclass(frozen=True)
class Geometry(EngineCall["CollectiveSenderSpec"]):
    """The packing geometry the worker declares."""

    operation = method_name(CollectiveEngineRole.refit_geometry)

    def run(self, target: VllmWorkerRole) -> CollectiveSenderSpec:
        return target.endpoint.refit_geometry()


@dataclass(frozen=True)
class Abort(EngineCall[None]):
    """Abort the worker's group (only if it is ``group_name``, when given)."""

    operation = method_name(CollectiveMemberRole.refit_abort)
    cause: str
    group_name: str | None = None

    def run(self, target: VllmWorkerRole) -> None:
        target.endpoint.refit_abort(self.cause, self.group_name)


@dataclass(frozen=True)
class Status(EngineCall[WorkerRefitStatus]):
    """The worker's refit state."""

    operation = method_name(CollectiveEngineRole.refit_status)

    def run(self, target: VllmWorkerRole) -> WorkerRefitStatus:
        return target.status()


@dataclass(frozen=True)
class Transfer(EngineCall["TransferStats | None"]):
    """Receive ``version`` within ``timeout_s``: streamed into the paused engine's model, or
    staged beside it (polled)."""

    operation = method_name(CollectiveMemberRole.refit_transfer)
    writes = True
    version: int
    timeout_s: float | None

    def run(self, target: VllmWorkerRole) -> TransferStats | None:
        return target.transfer(self.version, self.timeout_s)

    def pauses(self, staged: bool) -> bool:
        return not staged

    def stages(self, staged: bool) -> bool:
        return staged

    def rpc_timeout_s(self, control_timeout_s: float, grace_s: float) -> float | None:
        return _plus_grace(self.timeout_s, grace_s)


@dataclass(frozen=True)
class Stage(EngineCall[None]):
    """Start staging ``version`` beside the serving engine (polled)."""

    operation = method_name(CollectiveStagingRole.refit_stage)
    writes = True
    version: int
    timeout_s: float | None

    def run(self, target: VllmWorkerRole) -> None:
        target.stage(self.version, self.timeout_s)

    def stages(self, staged: bool) -> bool:
        return True

    def rpc_timeout_s(self, control_timeout_s: float, grace_s: float) -> float | None:
        return _plus_grace(self.timeout_s, grace_s)


@dataclass(frozen=True)
class Staging(EngineCall["TransferStats | None"]):
    """Poll the worker's staging: its stats once it ended, None while it runs."""

    operation = method_name(CollectiveStagingRole.refit_stage)

    def run(self, target: VllmWorkerRole) -> TransferStats | None:
        return target.staging()


@dataclass(frozen=True)
class Commit(EngineCall[int]):
    """Serve ``version`` (the engine paused); returns it."""

    operation = method_name(CollectiveEngineRole.refit_commit)
    writes = True
    version: int

    def run(self, target: VllmWorkerRole) -> int:
        return target.commit(self.version)

    def pauses(self, staged: bool) -> bool:
        return True

    def served(self, result: int) -> int | None:
        return result


@dataclass(frozen=True)
class CommitStaged(EngineCall[CommitStats]):
    """Load the staged ``version`` and serve it (the engine paused)."""

    operation = method_name(CollectiveStagingRole.refit_commit_staged)
    writes = True
    version: int

    def run(self, target: VllmWorkerRole) -> CommitStats:
        return target.commit_staged(self.version)

    def pauses(self, staged: bool) -> bool:
        return True

    def served(self, result: CommitStats) -> int | None:
        return result.version

    def timed(self, result: CommitStats, paused_s: float) -> CommitStats:
        return CommitStats(result.version, paused_s)


@dataclass(frozen=True)
class DropStaged(EngineCall[None]):
    """Forget the staged ``version``."""

    operation = method_name(CollectiveStagingRole.refit_drop_staged)
    version: int

    def run(self, target: VllmWorkerRole) -> None:
        target.drop_staged()


_ROLE_CALLS: Mapping[str, type[EngineCall[Any]]] = {
    call.operation: call
    for call in (
        Device,
        Plan,
        Join,
        Geometry,
        Abort,
        Status,
        Transfer,
        Stage,
        Commit,
        CommitStaged,
        DropStaged,
    )
}


def engine_call(operation: str, args: tuple[Any, ...]) -> EngineCall[Any]:
    """The call that carries out the engine role's method ``operation`` with ``args`` (the
    synchronizer's participant call, type-checked against the role where it was written).

    Raises:
        ValueError: ``operation`` is not a method of the engine role.
    """
    call = _ROLE_CALLS.get(operation)
    if call is None:
        raise ValueError(f"{operation!r} is not a method of the engine role")
    return call(*args)
