"""How a group's members meet: the store, the backend they agree on, the communicator, the
warm-up's check, and what a failed rendezvous raises.

Rank 0 hosts a ``TCPStore`` on the spec's (fresh) port and every rank is a client of it, as
vLLM's stateless groups do; the communicator is built directly over the store (under the
convention's key prefix), outside torch.distributed's default world.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import cast

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed import DistStoreError

from refit_core import ProtocolError, RefitError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_nccl.group.calls import first_line
from refit_nccl.group.devices import DeviceReport, DeviceType, choose_backend
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Backend, BackendTraits, Communicator, traits_for

__all__ = ["agree_on_backend", "build_communicator", "check_warm_up", "rendezvous_error"]

logger = logging.getLogger(__name__)


def agree_on_backend(spec: GroupSpec, store: TCPStore) -> BackendTraits:
    """Publish this member's device report, read everyone's, choose the backend.

    Every member reads the same reports and so reaches the same verdict; a mismatch raises
    :class:`~refit_nccl.group.devices.DeviceMismatchError` on all of them.
    """
    agreeing = PrefixStore(
        spec.convention.store_prefix(spec.name, spec.host, spec.port, None), store
    )
    mine = DeviceReport.of(spec.device)
    agreeing.set(f"device/{spec.rank}", f"{mine.device} {' '.join(mine.backends)}")
    keys = [f"device/{rank}" for rank in range(spec.world_size)]
    agreeing.wait(keys)
    reports: dict[str, DeviceReport] = {}
    for rank, key in enumerate(keys):
        device, *backends = agreeing.get(key).decode().split()
        reports[f"rank {rank}"] = DeviceReport(
            cast(DeviceType, device), cast(tuple[Backend, ...], tuple(backends))
        )
    backend = choose_backend(reports)
    logger.info("%s: members agreed on %s", spec.label, backend)
    return traits_for(backend, spec.rendezvous)


def build_communicator(
    spec: GroupSpec,
    traits: BackendTraits,
    store: TCPStore,
    timeout: timedelta,
    device: torch.device,
) -> Communicator:
    """The backend's communicator over ``store`` (constructed, not connected yet)."""
    prefix = spec.convention.store_prefix(spec.name, spec.host, spec.port, traits.name)
    construct_timeout = (
        timeout if traits.per_call_timeout else timedelta(seconds=spec.disarmed_timeout_s)
    )
    return traits.construct(
        store if traits.raw_store else PrefixStore(prefix, store),
        spec.rank,
        spec.world_size,
        construct_timeout,
        spec.host,
        device,
    )


def check_warm_up(spec: GroupSpec, summed: float, abort: Callable[[str], None]) -> None:
    """Check what the convention's warm-up all-reduce summed to.

    Raises:
        ProtocolError: not what the convention expects (a member follows another
            rendezvous); the group is aborted first.
    """
    expected = spec.convention.expected_warm_up(spec.world_size)
    if summed != expected:
        cause = f"warm-up all-reduce summed to {summed}, not {expected}"
        abort(cause)
        raise ProtocolError(f"{spec.label}: {cause} (a member follows another rendezvous)")


def rendezvous_error(
    spec: GroupSpec, exc: BaseException, deadline: Deadline, abort: Callable[[str], None]
) -> RefitError:
    """The error a failed rendezvous raises; aborts the group with its cause."""
    if isinstance(exc, RefitError):
        abort(str(exc))
        return exc
    cause = f"{spec.label}: rendezvous at {spec.host}:{spec.port} failed"
    abort(f"{cause}: {first_line(exc)}")
    if deadline.expired() or isinstance(exc, TimeoutError | DistStoreError):
        return RefitTimeoutError(f"{cause} by its deadline: {first_line(exc)}")
    return RefitError(f"{cause}: {first_line(exc)}", is_retryable=True)
