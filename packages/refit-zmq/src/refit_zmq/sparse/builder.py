"""The factory's builder of the (vllm, non-colocated, ``zmq_sparse``) row.

``policy`` is a ``PolicyLike`` in the controller's process (its shards stream from threads
here); ``generation`` lists the relays that run beside its engine workers
(:class:`ZmqRelayGeneration`). The API key is taken from ``REFIT_ZMQ_API_KEY`` and CURVE keys
from ``REFIT_ZMQ_CURVE_*`` when those are set; ``refit_buffer_size_gb`` bounds a payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from refit_core.protocols import PolicyLike
from refit_core.registry import SynchronizerRequest
from refit_zmq.sparse.synchronizer import ZmqSparseOptions, ZmqSparseWeightSynchronizer

__all__ = ["CommitListener", "ZmqRelayGeneration", "build_zmq_sparse_synchronizer"]


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
        ValueError: a policy without ``weight_source()`` or a generation without
            ``relay_addresses()``.
    """
    policy = request.policy
    generation = request.generation
    if not isinstance(policy, PolicyLike):
        raise ValueError("policy must provide weight_source()")
    if not isinstance(generation, ZmqRelayGeneration):
        raise ValueError("generation must provide relay_addresses() (relays beside its workers)")
    options = ZmqSparseOptions.from_env(bucket_size_bytes=request.refit_buffer_size_bytes)
    return ZmqSparseWeightSynchronizer(
        policy,
        generation.relay_addresses,
        refit_timeout_s=request.refit_timeout_s,
        options=options,
        on_commit=generation.refit_committed if isinstance(generation, CommitListener) else None,
    )
