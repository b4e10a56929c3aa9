"""Who a participant is in one group and where the group meets (:class:`GroupSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

from refit_nccl.group.devices import DeviceType, native_backend
from refit_nccl.group.rendezvous import Convention, ConventionName, convention_of
from refit_nccl.group.traits import Backend, traits_for

__all__ = ["DISARMED_TIMEOUT_S", "GroupSpec"]

DISARMED_TIMEOUT_S = 1800.0
"""Timeout of calls made under a disarmed deadline (torch's own default)."""


@dataclass(frozen=True)
class GroupSpec:
    """Who a participant is in one group and where the group meets.

    Attributes:
        host: address of the TCPStore that rank 0 hosts.
        port: the store's port; use a fresh one per group.
        rank: this participant's rank.
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None: the members agree on it at
            connect from the devices they report
            (:func:`~refit_nccl.group.devices.choose_backend`).
        name: the group's name (prefix of its store keys under refit's rendezvous).
        disarmed_timeout_s: timeout of calls made under a disarmed deadline.
        rendezvous: whose store keys and warm-up the group follows: ``"refit"``, ``"vllm"``
            for a group that vLLM's peers join (:mod:`refit_nccl.group.rendezvous`): on gloo
            vLLM's stateless torch group, on ``nccl`` vLLM's own ``PyNcclCommunicator``
            (:mod:`refit_nccl.vllm_native`, which needs vLLM importable here), or ``"sglang"``
            for one that SGLang's ``init_custom_process_group`` joins.
        in_child: run the communicator in a child process that is killed at the deadline
            or on abort (:class:`~refit_nccl.group.child.process_group.ChildProcessGroup`;
            gloo only); build the group with
            :func:`~refit_nccl.group.child.process_group.make_group`.
        device: the device this member reports when ``backend`` is None (None: this
            process's); ignored otherwise.
    """

    host: str
    port: int
    rank: int
    world_size: int
    backend: Backend | None = "gloo"
    name: str = "refit"
    disarmed_timeout_s: float = DISARMED_TIMEOUT_S
    rendezvous: ConventionName = "refit"
    in_child: bool = False
    device: DeviceType | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.disarmed_timeout_s > 0:
            raise ValueError(f"disarmed_timeout_s must be > 0, got {self.disarmed_timeout_s}")
        if self.backend is not None:
            traits_for(self.backend, self.rendezvous)
        convention_of(self.rendezvous)
        if self.rendezvous != "refit" and self.backend is None:
            raise ValueError(f"a {self.rendezvous} peer joins a group of a known backend; name it")
        if self.device is not None:
            native_backend(self.device)
        if self.in_child and self.backend != "gloo":
            raise ValueError(
                "a child-process communicator moves CPU tensors (gloo); CUDA tensors would "
                "need CUDA IPC handles, which are not built"
            )

    @property
    def convention(self) -> Convention:
        """The rendezvous convention the group follows."""
        return convention_of(self.rendezvous)

    @property
    def label(self) -> str:
        """``name rank r/n`` for messages."""
        return f"{self.name} rank {self.rank}/{self.world_size}"
