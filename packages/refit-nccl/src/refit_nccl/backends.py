"""What differs between the communicator backends: construction, device, how calls are released.

Measured on CPU (DESIGN.md §4): gloo's ``abort()`` does not release a call in flight, but a
per-call timeout does. NCCL's communicator abort releases blocked calls, while a per-call
timeout there would hand the failure to torch's own NCCL watchdog, which may tear the process
down; so NCCL calls run under refit's watchdog with the group's long default timeout.
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

__all__ = [
    "Backend",
    "BackendTraits",
    "CallHandle",
    "Communicator",
    "default_backend",
    "traits_of",
]

Backend = Literal["gloo", "nccl"]


class CallHandle(Protocol):
    """An issued call (torch's ``Work``): ``wait`` raises if it fails or times out."""

    def wait(self, timeout: timedelta) -> object: ...


class Communicator(Protocol):
    """The calls refit makes on a communicator (``ProcessGroupGloo``/``NCCL``, or
    :class:`~refit_nccl.child.ChildCommunicator`)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> CallHandle: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> CallHandle: ...

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> CallHandle: ...  # noqa: N803

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> CallHandle: ...  # noqa: N803

    def abort(self) -> None: ...


_Constructor = Callable[[Store, int, int, timedelta, str], Communicator]


@dataclass(frozen=True)
class BackendTraits:
    """How one backend is built and how its blocked calls are released.

    Attributes:
        name: the backend.
        per_call_timeout: ops take the remaining deadline as their own timeout, which
            releases a blocked caller (gloo).
        abort_releases: ``abort()`` from another thread releases a blocked call (NCCL), so
            calls run under a :class:`~refit_nccl.watchdog.Watchdog`.
        construct: ``(store, rank, size, timeout, rendezvous host) -> process group``.
        waits_in_slices: a caller blocked in a collective waits in short slices and leaves
            when the group is aborted, abandoning the call (gloo: its abort releases nothing,
            but a timed-out ``wait`` of a collective leaves it running, and it ends by its own
            timeout later; the caller must not reuse its buffers).
    """

    name: Backend
    per_call_timeout: bool
    abort_releases: bool
    construct: _Constructor
    waits_in_slices: bool = False

    def device(self) -> torch.device:
        """The device this backend's tensors live on in the calling process."""
        if self.name == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _construct_gloo(
    store: Store, rank: int, size: int, timeout: timedelta, host: str
) -> Communicator:
    """Gloo over loopback when the rendezvous is on loopback, else over the default device."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # stub lacks it
    options._timeout = timeout
    loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    device = (
        ProcessGroupGloo.create_device(hostname=host)
        if loopback
        else ProcessGroupGloo.create_default_device()
    )
    options._devices = [device]
    return cast(Communicator, ProcessGroupGloo(store, rank, size, options))


def _construct_nccl(
    store: Store, rank: int, size: int, timeout: timedelta, host: str
) -> Communicator:
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return cast(Communicator, ProcessGroupNCCL(store, rank, size, options))


_TRAITS: dict[str, BackendTraits] = {
    "gloo": BackendTraits("gloo", per_call_timeout=True, abort_releases=False, construct=_construct_gloo, waits_in_slices=True),
    "nccl": BackendTraits("nccl", per_call_timeout=False, abort_releases=True, construct=_construct_nccl),
}  # fmt: skip


def traits_of(backend: str) -> BackendTraits:
    """The traits of ``backend``; ValueError for an unknown one."""
    try:
        return _TRAITS[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(_TRAITS)}") from None


def default_backend() -> Backend:
    """``nccl`` where a CUDA GPU is usable, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"
