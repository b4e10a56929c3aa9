"""The ``vllm.non-colocated.collective`` row: build a synchronizer from a factory request.

``policy`` is either a trainer whose ranks are Ray actors (:class:`CollectivePolicy`) or a
plain ``PolicyLike`` in the controller's process, which then sends as the only trainer rank.
``generation`` lists its engine shards as Ray actors serving :class:`EngineEndpoint`'s
``refit_*`` methods (:class:`CollectiveGeneration`); engines of another protocol bring their
own trainer side (:class:`PeerGeneration`: unmodified vLLM engines on vLLM's NCCL weight
transfer, :class:`~refit_nccl.vllm_native.engine.VllmNativeGeneration`). ``train_cluster``
provides each group's rendezvous address on trainer rank 0's host. The group's backend is
chosen at every (re)build from the devices the members report, never from this process's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from refit_core.backend import (
    ActorParticipant,
    LocalParticipant,
    Participant,
    PolicyLike,
    RendezvousCluster,
    SynchronizerRequest,
)
from refit_nccl.controller.options import CollectiveOptions
from refit_nccl.controller.synchronizer import CollectiveWeightSynchronizer
from refit_nccl.roles.contract import CollectiveEngineRole, CollectiveTrainerRole, ShardMap
from refit_nccl.roles.trainer import TrainerEndpoint

__all__ = [
    "CollectiveGeneration",
    "CollectivePolicy",
    "PeerGeneration",
    "build_collective_synchronizer",
]


@runtime_checkable
class CollectivePolicy(Protocol):
    """A trainer whose ranks are Ray actors serving :class:`TrainerEndpoint`'s methods."""

    def collective_trainers(self) -> Sequence[Any]:
        """Actor handles of the trainer ranks, rank 0 (the sender) first."""
        ...


@runtime_checkable
class CollectiveGeneration(Protocol):
    """Engine shards whose workers are Ray actors serving :class:`EngineEndpoint`'s methods,
    or ready-made :class:`~refit_core.backend.Participant` objects (vLLM engines:
    :class:`refit_nccl.vllm.VllmCollectiveGeneration`)."""

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        """Shard index -> its workers' actor handles or participants; a restarted worker has
        a new one."""
        ...


@runtime_checkable
class PeerGeneration(Protocol):
    """Engines that speak another protocol than refit's endpoints and bring the trainer side
    that speaks it."""

    def collective_trainers_for(
        self, policy: PolicyLike
    ) -> Sequence[Participant[CollectiveTrainerRole]]:
        """The trainer ranks (rank 0 sends) that drive these engines for ``policy``."""
        ...


def _trainers(policy: object, generation: object) -> list[Participant[CollectiveTrainerRole]]:
    if isinstance(generation, PeerGeneration):
        if not isinstance(policy, PolicyLike):
            raise ValueError("policy must provide weight_source() for these engines")
        return list(generation.collective_trainers_for(policy))
    if isinstance(policy, CollectivePolicy):
        handles = policy.collective_trainers()
        return [
            ActorParticipant[CollectiveTrainerRole](h, f"trainer {rank}")
            for rank, h in enumerate(handles)
        ]
    if isinstance(policy, PolicyLike):
        return [LocalParticipant[CollectiveTrainerRole](TrainerEndpoint(policy), "trainer 0")]
    raise ValueError(
        "policy must provide collective_trainers() (Ray trainer ranks) or weight_source()"
    )


def _engine_participant(worker: Any, label: str) -> Participant[CollectiveEngineRole]:
    if isinstance(worker, Participant):
        participant: Participant[CollectiveEngineRole] = worker
        return participant
    return ActorParticipant[CollectiveEngineRole](worker, label)


def build_collective_synchronizer(request: SynchronizerRequest) -> CollectiveWeightSynchronizer:
    """The factory's builder for (vllm, non-colocated, collective).

    Raises:
        ValueError: a policy, generation or train_cluster without the methods it needs, or
            options whose bucket size disagrees with ``refit_buffer_size_gb``.
    """
    generation = request.generation
    if not isinstance(generation, CollectiveGeneration):
        raise ValueError("generation must provide collective_shards() (engine worker actors)")
    cluster = request.train_cluster
    if not isinstance(cluster, RendezvousCluster):
        raise ValueError("train_cluster must provide get_master_address_and_port()")

    def shards() -> ShardMap:
        return {
            index: [_engine_participant(h, f"shard {index} worker {j}") for j, h in enumerate(hs)]
            for index, hs in generation.collective_shards().items()
        }

    return CollectiveWeightSynchronizer(
        _trainers(request.policy, generation),
        shards,
        cluster.get_master_address_and_port,
        refit_timeout_s=request.refit_timeout_s,
        options=request.with_buffer_size(
            request.options_as(CollectiveOptions) or CollectiveOptions(), "buffer_size_bytes"
        ),
    )
