"""Backend rows and their discovery through the ``refit.backends`` entry-point group.

A row is one (generation backend, topology, transport) combination of DESIGN.md's table.
Core knows every row (so it can say which package brings it); the package that implements a
row registers an entry point named ``backend.topology.transport`` whose value is a
``"module:attr"`` string naming a builder ``(SynchronizerRequest) -> WeightSynchronizer``.
Builders are imported on first use only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from refit_core.errors import BackendNotInstalledError

if TYPE_CHECKING:
    from refit_core.synchronizer import WeightSynchronizer

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_ROWS",
    "BackendRow",
    "RowStatus",
    "SynchronizerBuilder",
    "SynchronizerRequest",
    "find_row",
    "load_builder",
    "row_status",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "refit.backends"

Topology = Literal["colocated", "non-colocated"]


@dataclass(frozen=True)
class SynchronizerRequest:
    """Everything ``create_weight_synchronizer`` was given, validated, with the row resolved."""

    policy: Any
    generation: Any
    generation_backend: str
    colocated: bool
    transport: str
    train_cluster: Any = None
    inference_cluster: Any = None
    refit_buffer_size_gb: float | None = None
    refit_timeout_s: float | None = None

    @property
    def refit_buffer_size_bytes(self) -> int | None:
        """``refit_buffer_size_gb`` in bytes (GiB), or None when unset."""
        if self.refit_buffer_size_gb is None:
            return None
        return int(self.refit_buffer_size_gb * 1024**3)


SynchronizerBuilder = Callable[[SynchronizerRequest], "WeightSynchronizer"]


@dataclass(frozen=True)
class BackendRow:
    """One row of the backend table and the package that implements it.

    ``on_failure`` says what an engine serves after a refit of this row failed (every row:
    exactly its previous version, or nothing until a complete refit; never mixed weights).
    """

    backend: str
    topology: Topology
    transport: str
    package: str
    extra: str
    description: str
    on_failure: str = ""

    @property
    def key(self) -> str:
        """The entry-point name of this row."""
        return f"{self.backend}.{self.topology}.{self.transport}"

    @property
    def install_hint(self) -> str:
        """The pip line that brings this row's package."""
        return f'pip install "refit-core[{self.extra}]"'


KNOWN_ROWS: tuple[BackendRow, ...] = (
    BackendRow(
        "vllm", "colocated", "ipc", "refit-zmq", "vllm",
        "ZMQ control + CUDA IPC handles (shared memory on CPU)",
        "previous version (staged: default); closed until a complete refit (streamed)",
    ),
    BackendRow(
        "vllm", "non-colocated", "collective", "refit-nccl", "vllm",
        "NCCL collective broadcast of packed buckets",
        "previous version (staged: default); closed until a complete refit (streamed)",
    ),
    BackendRow(
        "vllm", "non-colocated", "zmq_sparse", "refit-zmq", "vllm",
        "sparse deltas over the transactional ZMQ relay tree",
        "previous version, bit for bit; closed until a complete refit if loading a committed delta into the model fails",
    ),
    BackendRow(
        "sglang", "colocated", "ray_ipc", "refit-sglang", "sglang",
        "Ray CUDA-IPC transfer of flattened buckets",
    ),
    BackendRow(
        "sglang", "non-colocated", "collective", "refit-sglang", "sglang",
        "NCCL broadcast over SGLang's weight-update group",
    ),
    BackendRow(
        "megatron", "colocated", "reshard", "refit-nccl", "megatron",
        "in-process reshard, training -> inference layout",
    ),
    BackendRow(
        "megatron", "non-colocated", "collective", "refit-nccl", "megatron",
        "reshard over a collective",
    ),
    BackendRow(
        "dynamo", "non-colocated", "collective", "refit-dynamo", "dynamo",
        "Dynamo admin HTTP routes + NCCL broadcast",
    ),
)  # fmt: skip

DEFAULT_TRANSPORT: dict[tuple[str, Topology], str] = {
    ("vllm", "colocated"): "ipc",
    ("vllm", "non-colocated"): "collective",
    ("sglang", "colocated"): "ray_ipc",
    ("sglang", "non-colocated"): "collective",
    ("megatron", "colocated"): "reshard",
    ("megatron", "non-colocated"): "collective",
    ("dynamo", "non-colocated"): "collective",
}

UNSUPPORTED: dict[tuple[str, Topology], str] = {
    ("dynamo", "colocated"): (
        "a Dynamo fleet is a set of managed workers on their own GPUs; "
        "colocated refit is not supported"
    ),
}

KNOWN_BACKENDS: tuple[str, ...] = tuple(dict.fromkeys(r.backend for r in KNOWN_ROWS))


def topology_of(colocated: bool) -> Topology:
    """The topology name of a ``colocated`` flag."""
    return "colocated" if colocated else "non-colocated"


def find_row(backend: str, colocated: bool, transport: str | None) -> BackendRow:
    """The row for a backend, topology and transport (None = the topology's default).

    Raises:
        ValueError: unknown backend, or a transport this backend and topology do not have.
        NotImplementedError: a combination refit does not support (colocated dynamo).
    """
    if backend not in KNOWN_BACKENDS:
        raise ValueError(
            f"unknown generation_backend {backend!r}; known: {', '.join(KNOWN_BACKENDS)}"
        )
    topology = topology_of(colocated)
    if (backend, topology) in UNSUPPORTED:
        raise NotImplementedError(f"{backend} {topology}: {UNSUPPORTED[backend, topology]}")
    rows = [r for r in KNOWN_ROWS if r.backend == backend and r.topology == topology]
    wanted = DEFAULT_TRANSPORT[backend, topology] if transport is None else transport
    for row in rows:
        if row.transport == wanted:
            return row
    known = ", ".join(repr(r.transport) for r in rows)
    raise ValueError(
        f"unknown transport {wanted!r} for {backend} {topology}; known: {known} (or None)"
    )


@dataclass(frozen=True)
class RowStatus:
    """Whether a row's package is installed, its version, and whether it registers the row."""

    row: BackendRow
    installed_version: str | None
    entry_point: str | None

    @property
    def installed(self) -> bool:
        """Whether the row's package is installed."""
        return self.installed_version is not None

    @property
    def implemented(self) -> bool:
        """Whether the installed package registers a builder for the row."""
        return self.entry_point is not None


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def row_status(row: BackendRow) -> RowStatus:
    """What is installed for ``row``."""
    ep = _entry_points().get(row.key)
    return RowStatus(row, _installed_version(row.package), ep.value if ep else None)


def load_builder(row: BackendRow) -> SynchronizerBuilder:
    """Import the builder of ``row``.

    Raises:
        BackendNotInstalledError: the row's package (or one of its dependencies) is missing.
        NotImplementedError: the package is installed but does not implement the row yet.
    """
    version = _installed_version(row.package)
    if version is None:
        raise BackendNotInstalledError(
            f"{row.key} needs the package {row.package}, which is not installed",
            install_hint=row.install_hint,
        )
    ep = _entry_points().get(row.key)
    if ep is None:
        raise NotImplementedError(
            f"{row.key} ({row.description}) is not implemented by {row.package} {version} yet"
        )
    try:
        builder: SynchronizerBuilder = ep.load()
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"{row.key} could not be imported from {ep.value}: {exc}",
            install_hint=row.install_hint,
        ) from exc
    logger.debug("loaded builder %s for %s", ep.value, row.key)
    return builder
