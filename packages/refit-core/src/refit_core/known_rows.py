"""refit's own rows, known to core so it can say which package brings one that is missing.

Only install hints live here: what a row is and does is declared by the package that
implements it (:mod:`refit_core.rows`), and a row of any other package is found through its
entry point alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from refit_core import extras
from refit_core.rows import Topology

__all__ = ["KNOWN_ROWS", "UNSUPPORTED", "KnownRow", "known_default", "known_row"]


@dataclass(frozen=True)
class KnownRow:
    """A row of one of refit's packages, and how to install it."""

    backend: str
    topology: Topology
    transport: str
    package: str
    extra: str
    default: bool = False

    @property
    def key(self) -> str:
        """The row's entry-point name."""
        return f"{self.backend}.{self.topology}.{self.transport}"

    @property
    def install_hint(self) -> str:
        """The pip line that brings this row's package."""
        return extras.install_hint(self.extra)


KNOWN_ROWS: tuple[KnownRow, ...] = (
    KnownRow("vllm", "colocated", "ipc", "refit-zmq", "vllm", default=True),
    KnownRow("vllm", "non-colocated", "collective", "refit-nccl", "vllm", default=True),
    KnownRow("vllm", "non-colocated", "zmq_sparse", "refit-zmq", "vllm"),
    KnownRow("vllm", "colocated", "lora", "refit-zmq", "vllm"),
    KnownRow("vllm", "non-colocated", "lora", "refit-zmq", "vllm"),
    KnownRow("sglang", "colocated", "ray_ipc", "refit-sglang", "sglang", default=True),
    KnownRow("sglang", "non-colocated", "collective", "refit-sglang", "sglang", default=True),
    KnownRow("megatron", "colocated", "reshard", "refit-nccl", "megatron", default=True),
    KnownRow("megatron", "non-colocated", "collective", "refit-nccl", "megatron", default=True),
    KnownRow("dynamo", "non-colocated", "collective", "refit-dynamo", "dynamo", default=True),
)

UNSUPPORTED: dict[tuple[str, Topology], str] = {
    ("dynamo", "colocated"): (
        "a Dynamo fleet is a set of managed workers on their own GPUs; "
        "colocated refit is not supported"
    ),
}
"""Combinations refit declines (NotImplementedError) unless an installed package serves them."""


def known_row(key: str) -> KnownRow | None:
    """refit's row named ``key``, if refit has one."""
    return next((r for r in KNOWN_ROWS if r.key == key), None)


def known_default(backend: str, topology: Topology) -> KnownRow | None:
    """refit's default row for ``backend`` and ``topology``, if refit has one."""
    return next(
        (r for r in KNOWN_ROWS if (r.backend, r.topology) == (backend, topology) and r.default),
        None,
    )
