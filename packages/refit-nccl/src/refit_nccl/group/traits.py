"""What differs between the communicator backends: construction, device, how calls are released.

Measured on CPU (DESIGN.md §4): gloo's ``abort()`` does not release a call in flight, but a
per-call timeout does. NCCL's communicator abort releases blocked calls, while a per-call
timeout there would hand the failure to torch's own NCCL watchdog, which may tear the process
down; so NCCL calls run under refit's watchdog with the group's long default timeout.

An NCCL group's communicator is created eagerly, bound to its device, while the group
connects (``eager_connect_single_device``; binding the device makes torch create it
non-blocking, so the watchdog's abort ends an init that a peer never completes) rather than
lazily inside the first collective. A group on vLLM's rendezvous with the ``nccl`` backend is
vLLM's own data plane: :mod:`refit_nccl.vllm_native` builds vLLM's ``PyNcclCommunicator``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol, cast

import torch
from torch._C._distributed_c10d import Store

from refit_nccl.group.rendezvous import ConventionName

__all__ = [
    "Backend",
    "BackendTraits",
    "CallHandle",
    "Communicator",
    "traits_for",
    "traits_of",
]

Backend = Literal["gloo", "nccl"]


class CallHandle(Protocol):
    """An issued call (torch's ``Work``): ``wait`` raises if it fails or times out."""

    def wait(self, timeout: timedelta) -> object: ...


class RewaitableHandle(CallHandle, Protocol):
    """A call whose ``wait`` may time out and be waited on again (gloo's collectives)."""

    def is_completed(self) -> bool: ...


class Communicator(Protocol):
    """The calls refit makes on a communicator (``ProcessGroupGloo``/``NCCL``, or
    :class:`~refit_nccl.group.child.communicator.ChildCommunicator`)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> CallHandle: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> CallHandle: ...

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> CallHandle: ...  # noqa: N803

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> CallHandle: ...  # noqa: N803

    def abort(self) -> None: ...


_Constructor = Callable[[Store, int, int, timedelta, str, torch.device], Communicator]
_Connector = Callable[[Communicator, torch.device, timedelta], None]


def _connected_lazily(pg: Communicator, device: torch.device, timeout: timedelta) -> None:
    """Nothing to do: the communicator is ready once constructed (gloo)."""


@dataclass(frozen=True)
class BackendTraits:
    """How one backend is built and how its blocked calls are released.

    Attributes:
        name: the backend.
        per_call_timeout: ops take the remaining deadline as their own timeout, which
            releases a blocked caller (gloo).
        abort_releases: ``abort()`` from another thread releases a blocked call (NCCL), so
            calls run under a :class:`~refit_nccl.group.watchdog.Watchdog`.
        construct: ``(store, rank, size, timeout, rendezvous host, device) -> communicator``;
            quick, creates nothing that waits on peers.
        connect: ``(communicator, device, timeout)``: creates the communicator's connections
            with every peer; the group has the communicator by then, so an abort ends it.
        raw_store: the communicator takes the group's store itself, not the convention's
            prefixed view (vLLM's ``StatelessProcessGroup`` keys have no prefix).
        warms_up_itself: connecting already ran the convention's warm-up all-reduce.
        require: raises when this process cannot build the communicator (checked before
            the rendezvous, so no peer is left waiting).
        waits_in_slices: a caller blocked in a collective waits in short slices and leaves
            when the group is aborted, abandoning the call (gloo: its abort releases nothing,
            but a timed-out ``wait`` of a collective leaves it running, and it ends by its own
            timeout later; the caller must not reuse its buffers).
    """

    name: Backend
    per_call_timeout: bool
    abort_releases: bool
    construct: _Constructor
    connect: _Connector = _connected_lazily
    raw_store: bool = False
    warms_up_itself: bool = False
    require: Callable[[], None] = lambda: None
    waits_in_slices: bool = False

    def device(self) -> torch.device:
        """The device this backend's tensors live on in the calling process."""
        if self.name == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _construct_gloo(
    store: Store, rank: int, size: int, timeout: timedelta, host: str, device: torch.device
) -> Communicator:
    """Gloo over loopback when the rendezvous is on loopback, else over the default device."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # stub lacks it
    options._timeout = timeout
    loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    gloo_device = (
        ProcessGroupGloo.create_device(hostname=host)
        if loopback
        else ProcessGroupGloo.create_default_device()
    )
    options._devices = [gloo_device]
    return cast(Communicator, ProcessGroupGloo(store, rank, size, options))


def _construct_nccl(
    store: Store, rank: int, size: int, timeout: timedelta, host: str, device: torch.device
) -> Communicator:
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return cast(Communicator, ProcessGroupNCCL(store, rank, size, options))


def _connect_nccl(pg: Communicator, device: torch.device, timeout: timedelta) -> None:
    """Create the NCCL communicator now, on ``device``, instead of in the first collective.

    Binding the device first makes torch create it non-blocking, so ``abort()`` from the
    watchdog ends an init that a peer never completes.
    """
    backend: Any = pg
    backend.bound_device_id = device
    backend.eager_connect_single_device(device)


def _construct_pynccl(
    store: Store, rank: int, size: int, timeout: timedelta, host: str, device: torch.device
) -> Communicator:
    from refit_nccl.vllm_native.communicator import VllmNcclCommunicator

    return VllmNcclCommunicator(store, rank, size, device)


def _connect_pynccl(pg: Communicator, device: torch.device, timeout: timedelta) -> None:
    from refit_nccl.vllm_native.communicator import VllmNcclCommunicator

    cast(VllmNcclCommunicator, pg).connect(timeout)


def _require_pynccl() -> None:
    from refit_nccl.vllm_native.availability import require_vllm_nccl

    require_vllm_nccl()


_TRAITS: dict[str, BackendTraits] = {
    "gloo": BackendTraits("gloo", per_call_timeout=True, abort_releases=False, construct=_construct_gloo, waits_in_slices=True),
    "nccl": BackendTraits("nccl", per_call_timeout=False, abort_releases=True, construct=_construct_nccl, connect=_connect_nccl),
}  # fmt: skip

_VLLM_NCCL = BackendTraits(
    "nccl",
    per_call_timeout=False,
    abort_releases=True,
    construct=_construct_pynccl,
    connect=_connect_pynccl,
    raw_store=True,
    warms_up_itself=True,
    require=_require_pynccl,
)
"""vLLM's own NCCL data plane (``PyNcclCommunicator``), for a group on vLLM's rendezvous."""


def traits_of(backend: str) -> BackendTraits:
    """The traits of ``backend`` on refit's rendezvous; ValueError for an unknown one."""
    try:
        return _TRAITS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(_TRAITS)}") from None


def traits_for(backend: str, rendezvous: ConventionName) -> BackendTraits:
    """The traits of ``backend`` on the ``rendezvous`` convention: on vLLM's, ``nccl`` is
    vLLM's own ``PyNcclCommunicator`` (vLLM's receiver joins nothing else)."""
    traits = traits_of(backend)
    return _VLLM_NCCL if rendezvous == "vllm" and backend == "nccl" else traits
