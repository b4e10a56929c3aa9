"""Which communicator backend a group uses, chosen from what its members report.

Every participant reports, from its own process, where the tensors it moves live and which
backends it can join (:class:`DeviceReport`); the controller's own devices never count. The
group runs NCCL when every member is on CUDA and gloo when every member is on CPU. Mixed
devices are refused, as is a member that cannot join the chosen backend: its report says why
(for example vLLM missing where vLLM's NCCL data plane is needed) and what to install.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from refit_core import BackendNotInstalledError, GeometryMismatchError
from refit_nccl.group.traits import Backend

__all__ = [
    "DeviceMismatchError",
    "DeviceReport",
    "DeviceType",
    "choose_backend",
    "local_device",
    "native_backend",
]

DeviceType = Literal["cpu", "cuda"]

_NATIVE: dict[str, Backend] = {"cpu": "gloo", "cuda": "nccl"}


class DeviceMismatchError(GeometryMismatchError):
    """The members of a group cannot share one backend (mixed devices, or a member that
    cannot join the backend the others need); nothing was joined."""


def native_backend(device: DeviceType) -> Backend:
    """The backend that moves tensors on ``device``: ``nccl`` on CUDA, ``gloo`` on CPU."""
    try:
        return _NATIVE[device]
    except KeyError:
        raise ValueError(f"unknown device type {device!r}; known: cpu, cuda") from None


def local_device() -> DeviceType:
    """``cuda`` where this process can use a CUDA GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DeviceReport:
    """Where one participant's tensors live and which backends it can join.

    Attributes:
        device: the device type of the tensors it sends or receives.
        backends: the backends it can join, its device's own first.
        missing: why the device's own backend is not among ``backends`` ("" when it is).
        install_hint: what to install to make it available ("" when nothing would).
    """

    device: DeviceType
    backends: tuple[Backend, ...]
    missing: str = ""
    install_hint: str = ""

    def __post_init__(self) -> None:
        native_backend(self.device)
        if not self.backends and not self.missing:
            raise ValueError("a participant that can join no backend must say why (missing)")

    @classmethod
    def of(cls, device: DeviceType | None = None) -> DeviceReport:
        """A participant that can join its device's own backend, and gloo on CUDA too
        (gloo moves CPU tensors; the participant copies to and from its GPU).

        Args:
            device: None: this process's (:func:`local_device`).
        """
        device = device or local_device()
        return cls(device, ("nccl", "gloo") if device == "cuda" else ("gloo",))

    @classmethod
    def only(cls, device: DeviceType) -> DeviceReport:
        """A participant that can join nothing but its device's own backend (an engine whose
        receiver is NCCL-only)."""
        return cls(device, (native_backend(device),))

    @classmethod
    def lacking(cls, device: DeviceType, missing: str, install_hint: str) -> DeviceReport:
        """A participant on ``device`` whose own backend is unavailable, for ``missing``."""
        backends: tuple[Backend, ...] = ("gloo",) if device == "cuda" else ()
        return cls(device, backends, missing, install_hint)


def choose_backend(
    reports: Mapping[str, DeviceReport], requested: Backend | None = None
) -> Backend:
    """The one backend every reporting member can join.

    Args:
        reports: member label -> its report.
        requested: a backend the deployment asks for; None picks the devices' own.

    Raises:
        DeviceMismatchError: the members are on different device types, or one cannot
            join the backend (the error names them).
        BackendNotInstalledError: a member could join once something is installed (the
            error names it and the install line).
        ValueError: no reports.
    """
    if not reports:
        raise ValueError("no participant reported its device")
    by_device: dict[str, list[str]] = {}
    for label, report in reports.items():
        by_device.setdefault(report.device, []).append(label)
    if len(by_device) > 1:
        shown = "; ".join(f"on {d}: {', '.join(who)}" for d, who in sorted(by_device.items()))
        raise DeviceMismatchError(
            f"the group's members are on different devices ({shown}); one collective backend "
            "cannot serve them all: place every trainer rank and engine worker of the "
            "collective on the same device type"
        )
    device = next(iter(reports.values())).device
    backend = requested or native_backend(device)
    unable = {label: r for label, r in reports.items() if backend not in r.backends}
    if not unable:
        return backend
    hinted = {label: r for label, r in unable.items() if r.install_hint}
    if hinted and len(hinted) == len(unable):
        label, report = next(iter(hinted.items()))
        raise BackendNotInstalledError(
            f"{', '.join(hinted)} cannot join a {backend} group on {device}: {report.missing}",
            install_hint=report.install_hint,
        )
    details = "; ".join(
        f"{label} joins only {', '.join(r.backends) or 'nothing'}"
        + (f" ({r.missing})" if r.missing else "")
        for label, r in unable.items()
    )
    raise DeviceMismatchError(f"a {backend} group on {device} cannot be formed: {details}")
