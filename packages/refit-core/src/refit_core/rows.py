"""A backend row as the package that implements it declares it.

A row is one (generation backend, topology, transport) combination. Its package registers
an entry point in the ``refit.backends`` group named ``backend.topology.transport`` whose
value names a :class:`BackendRow` in a module that imports nothing heavy (the row is read to
list and pick rows; its builder is imported only when the row is built)::

    [project.entry-points."refit.backends"]
    "vllm.non-colocated.collective" = "refit_nccl.rows:COLLECTIVE"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["ENTRY_POINT_GROUP", "TOPOLOGIES", "BackendRow", "Topology", "topology_of"]

ENTRY_POINT_GROUP = "refit.backends"

Topology = Literal["colocated", "non-colocated"]
TOPOLOGIES: tuple[Topology, ...] = ("colocated", "non-colocated")

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_METHOD = re.compile(r"^[A-Za-z_]\w*$")


def topology_of(colocated: bool) -> Topology:
    """The topology name of a ``colocated`` flag."""
    return "colocated" if colocated else "non-colocated"


@dataclass(frozen=True)
class BackendRow:
    """One row of the backend table, declared by the package that implements it.

    Attributes:
        backend: the ``generation_backend`` it serves (``"vllm"``).
        topology: ``"colocated"`` or ``"non-colocated"``.
        transport: the ``transport`` name users pass (``"collective"``).
        builder: ``"module:function"`` of the builder, a callable taking a
            :class:`~refit_core.backend.SynchronizerRequest` and returning the
            :class:`~refit_core.WeightSynchronizer`; imported on first use.
        description: one line for ``refit backends``.
        default: whether it is the transport picked when ``transport`` is None (one row per
            backend and topology).
        options: ``"module:Class"`` of the options object ``create_weight_synchronizer``'s
            ``options=`` takes for this row; None: the row takes no options.
        train_cluster: the methods the row calls on ``train_cluster``; empty: not needed.
        inference_cluster: the same for ``inference_cluster``.
        can_stage: whether the row can stage a refit and commit it later (two-phase).
        on_failure: what an engine serves after a refit of this row failed (exactly its
            previous version, or nothing until a complete refit; never mixed weights).
        model_kinds: what the row refits: ``dense`` (a model's weights, every tensor in the
            engine's unquantized layout), ``lora`` (a LoRA adapter's tensors beside the base
            model), later ``moe`` and ``quantized``; ``refit backends`` lists them.
    """

    backend: str
    topology: Topology
    transport: str
    builder: str
    description: str
    default: bool = False
    options: str | None = None
    train_cluster: tuple[str, ...] = ()
    inference_cluster: tuple[str, ...] = ()
    can_stage: bool = False
    on_failure: str = ""
    model_kinds: tuple[str, ...] = ("dense",)

    def __post_init__(self) -> None:
        for field_name in ("backend", "transport"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not _NAME.match(value):
                raise ValueError(f"row {field_name} must be a lower-case identifier, got {value!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"row topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        for field_name in ("builder", "options"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, str) and _REFERENCE.match(value)):
                raise ValueError(f"row {field_name} must be 'module:attribute', got {value!r}")
        for field_name in ("train_cluster", "inference_cluster"):
            methods = getattr(self, field_name)
            if not isinstance(methods, tuple) or not all(
                isinstance(m, str) and _METHOD.match(m) for m in methods
            ):
                raise ValueError(f"row {field_name} must be a tuple of method names")
        if (
            not isinstance(self.model_kinds, tuple)
            or not self.model_kinds
            or not all(isinstance(k, str) and _NAME.match(k) for k in self.model_kinds)
        ):
            raise ValueError(
                f"row model_kinds must be a non-empty tuple of lower-case names, got "
                f"{self.model_kinds!r}"
            )

    @property
    def key(self) -> str:
        """The row's entry-point name, ``backend.topology.transport``."""
        return f"{self.backend}.{self.topology}.{self.transport}"

    @property
    def clusters_required(self) -> tuple[str, ...]:
        """The cluster arguments the row needs (``train_cluster``, ``inference_cluster``)."""
        return tuple(
            name
            for name, methods in (
                ("train_cluster", self.train_cluster),
                ("inference_cluster", self.inference_cluster),
            )
            if methods
        )
