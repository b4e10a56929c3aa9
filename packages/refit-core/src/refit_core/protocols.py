"""Structural types (typing only) for the objects a downstream framework hands to refit.

They describe exactly what refit's synchronizers use, so a framework's own classes (a
NeMo-RL ``RayVirtualCluster``, a policy worker group) satisfy them without inheriting.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from refit_core.sources import WeightSource

__all__ = ["ClusterLike", "GenerationLike", "PolicyLike", "RendezvousCluster"]


@runtime_checkable
class RendezvousCluster(Protocol):
    """A cluster that gives a rendezvous address: all a collective row asks of
    ``train_cluster``."""

    def get_master_address_and_port(self) -> tuple[str, int]:
        """Address and a free port on the cluster's first node, for rendezvous."""
        ...


@runtime_checkable
class ClusterLike(RendezvousCluster, Protocol):
    """A set of Ray placement groups with a rendezvous address (``train_cluster`` /
    ``inference_cluster``), for rows that place workers themselves."""

    def world_size(self) -> int:
        """Number of ranks (workers) in the cluster."""
        ...

    def get_placement_groups(self) -> list[Any]:
        """Ray placement groups, one per node or bundle set."""
        ...


@runtime_checkable
class PolicyLike(Protocol):
    """The trainer side: where the weights come from."""

    def weight_source(self) -> WeightSource:
        """A bounded-memory stream of the current weights under checkpoint names."""
        ...


@runtime_checkable
class GenerationLike(Protocol):
    """The engine side, as far as every synchronizer needs it."""

    def invalidate_kv_cache(self) -> bool:
        """Drop every cached prefix/KV computed with older weights; True on success."""
        ...
