"""The factory's builder of the (vllm, non-colocated, ``zmq_sparse``) row.

``policy`` is either a trainer whose ranks are Ray actors serving
:class:`~refit_zmq.relay.ShardProducer`'s ``refit_*`` methods (:class:`ZmqProducerPolicy`: each
rank streams its own shard) or a plain ``PolicyLike`` in the controller's process (its shards
stream from threads here); ``generation`` lists the relays that run beside its engine workers
(:class:`ZmqRelayGeneration`). Without ``options``, the API key is taken from
``REFIT_ZMQ_API_KEY`` and CURVE keys from ``REFIT_ZMQ_CURVE_*`` when those are set;
``refit_buffer_size_gb`` (GiB) bounds a payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from refit_core.backend import (
    ActorParticipant,
    LocalParticipant,
    Participant,
    PolicyLike,
    SynchronizerRequest,
)
from refit_zmq.relay import ShardProducer, ShardProducerRole
from refit_zmq.sparse.synchronizer import ZmqSparseOptions, ZmqSparseWeightSynchronizer

__all__ = [
    "CommitListener",
    "ZmqProducerPolicy",
    "ZmqRelayGeneration",
    "build_zmq_sparse_synchronizer",
    "shard_producers",
]


@runtime_checkable
class ZmqProducerPolicy(Protocol):
    """A trainer whose ranks are Ray actors serving :class:`~refit_zmq.relay.ShardProducer`'s
    ``refit_*`` methods (create them with ``max_concurrency >= 2``)."""

    def zmq_producers(self) -> Sequence[Any]:
        """Actor handles of the trainer ranks, in rank order (rank ``r`` streams shard ``r``)."""
        ...


@runtime_checkable
class ZmqRelayGeneration(Protocol):
    """Engines whose workers each run an :class:`~refit_zmq.sparse.EngineRelay`."""

    def relay_addresses(self) -> Sequence[str]:
        """The relays' addresses, one per engine shard, in shard order."""
        ...


@runtime_checkable
class CommitListener(Protocol):
    """A generation that must act once the relays committed (vLLM loads the relays' copy)."""

    def refit_committed(self, version: int) -> None:
        """Make the engines serve ``version``, which every relay committed."""
        ...


def build_zmq_sparse_synchronizer(request: SynchronizerRequest) -> ZmqSparseWeightSynchronizer:
    """The factory's builder for (vllm, non-colocated, zmq_sparse).

    Raises:
        ValueError: a policy with neither ``zmq_producers()`` nor ``weight_source()``, or a
            generation without ``relay_addresses()``.
    """
    generation = request.generation
    if not isinstance(generation, ZmqRelayGeneration):
        raise ValueError("generation must provide relay_addresses() (relays beside its workers)")
    given = request.options_as(ZmqSparseOptions)
    options = request.with_buffer_size(
        ZmqSparseOptions.from_env() if given is None else given, "bucket_size_bytes"
    )
    return ZmqSparseWeightSynchronizer(
        shard_producers(request.policy, options.shard_count),
        generation.relay_addresses,
        refit_timeout_s=request.refit_timeout_s,
        options=options,
        on_commit=generation.refit_committed if isinstance(generation, CommitListener) else None,
    )


def shard_producers(policy: object, shard_count: int) -> list[Participant[ShardProducerRole]]:
    """The producers of ``policy``: its Ray ranks, or ``shard_count`` local ones.

    Raises:
        ValueError: a policy with neither ``zmq_producers()`` nor ``weight_source()``.
    """
    if isinstance(policy, ZmqProducerPolicy):
        handles = policy.zmq_producers()
        return [
            ActorParticipant[ShardProducerRole](h, f"trainer rank {r}")
            for r, h in enumerate(handles)
        ]
    if isinstance(policy, PolicyLike):
        return [
            LocalParticipant[ShardProducerRole](ShardProducer(policy), f"producer {r}")
            for r in range(shard_count)
        ]
    raise ValueError("policy must provide zmq_producers() (Ray trainer ranks) or weight_source()")
