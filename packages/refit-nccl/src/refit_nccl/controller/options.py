"""The tuning of a :class:`~refit_nccl.controller.synchronizer.CollectiveWeightSynchronizer`
(:class:`CollectiveOptions`), checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.backend import check_field_types, checked_buffer_size
from refit_nccl.group.traits import Backend

__all__ = ["CollectiveOptions"]


@dataclass(frozen=True)
class CollectiveOptions:
    """Tuning of a :class:`~refit_nccl.controller.synchronizer.CollectiveWeightSynchronizer`.

    Attributes:
        backend: communicator backend; None picks it at every (re)build from the devices
            every member reports (``nccl`` when all are on CUDA, ``gloo`` when all are on
            CPU; mixed devices are refused). A backend given here must suit every member.
        buffer_size_bytes: bucket size the deployment requires (``refit_buffer_size_gb``);
            engines declaring another size are refused. None accepts what they declare.
        control_timeout_s: bound of non-collective calls (geometry, state, commit).
        grace_s: how long past the deadline the controller waits for participants to report
            their own timeout before naming them wedged.
        settle_s: once the deadline has passed and a participant has failed, how much longer
            the controller waits for the others (they release by the deadline plus ~1 s).
        status_timeout_s: how long ``status()``, ``recover()`` and the engine states of a
            failure wait for each engine's status (every engine asked at once; one that does
            not answer is unreachable, and is not asked again while that call is pending).
            None derives it from the deadline: a tenth of ``refit_timeout_s``, within
            [1 s, 2 s] (2 s without a deadline). A value above a quarter of
            ``refit_timeout_s`` is refused when the synchronizer is built.
        group_name: prefix of each group's store keys; a counter makes every group unique.
        communicator_in_child: every participant runs its communicator in a child process
            that is killed at the deadline or on abort (``ChildProcessGroup``, gloo only),
            for a backend whose calls neither time out nor end on abort; each (re)build
            starts fresh children.
    """

    backend: Backend | None = None
    buffer_size_bytes: int | None = None
    control_timeout_s: float = 60.0
    grace_s: float = 5.0
    settle_s: float = 1.5
    status_timeout_s: float | None = None
    group_name: str = "refit"
    communicator_in_child: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.buffer_size_bytes is not None:
            checked_buffer_size(self.buffer_size_bytes, "CollectiveOptions.buffer_size_bytes")
