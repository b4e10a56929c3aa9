"""The ``dynamo.non-colocated.collective`` row: refit-nccl's collective synchronizer whose
engine side is a :class:`DynamoRefitChannel`."""

from __future__ import annotations

import dataclasses

from refit_core.backend import LocalParticipant, PolicyLike, RendezvousCluster, SynchronizerRequest
from refit_dynamo.channel import DynamoRefitChannel
from refit_dynamo.participants import dynamo_shards
from refit_nccl import CollectiveOptions, CollectiveTrainerRole, CollectiveWeightSynchronizer
from refit_nccl.backend import VllmPeerTrainer

__all__ = ["build_dynamo_synchronizer"]

_OPTIONS = CollectiveOptions()


def build_dynamo_synchronizer(request: SynchronizerRequest) -> CollectiveWeightSynchronizer:
    """The factory's builder for (dynamo, non-colocated, collective).

    ``generation`` is the fleet's :class:`DynamoRefitChannel`; ``policy`` a ``PolicyLike`` in
    this process (the only trainer rank); ``train_cluster`` gives each group's rendezvous.
    ``refit_timeout_s`` bounds every trainer-side call; a Dynamo worker's own side cannot be
    aborted, so a refit past its deadline names the workers that may be wedged.

    Raises:
        ValueError: a wrong generation, policy or cluster, a bucket size other than vLLM's,
            or a ``control_timeout_s`` that does not outlast ``refit_timeout_s``.
    """
    channel = request.generation
    if not isinstance(channel, DynamoRefitChannel):
        raise ValueError(f"generation must be a DynamoRefitChannel, got {type(channel).__name__}")
    if not isinstance(request.policy, PolicyLike):
        raise ValueError("policy must provide weight_source()")
    cluster = request.train_cluster
    if not isinstance(cluster, RendezvousCluster):
        raise ValueError("train_cluster must provide get_master_address_and_port()")
    wanted = request.refit_buffer_size_bytes
    if wanted is not None and wanted != channel.sender_spec.buffer_size_bytes:
        raise ValueError(
            f"Dynamo's vLLM workers receive in {channel.sender_spec.buffer_size_bytes} B buckets; "
            f"refit_buffer_size_gb={request.refit_buffer_size_gb} cannot change that"
        )
    deadline_s = request.refit_timeout_s
    if deadline_s is not None and channel.control_timeout_s <= deadline_s + _OPTIONS.grace_s:
        # A worker's update call spans the whole transfer. Were it to time out before the
        # synchronizer gives up on it, the worker would be reported as failed rather than as
        # possibly wedged.
        raise ValueError(
            f"the channel's control_timeout_s ({channel.control_timeout_s:g} s) must exceed "
            f"refit_timeout_s + {_OPTIONS.grace_s:g} s ({deadline_s + _OPTIONS.grace_s:g} s)"
        )
    return CollectiveWeightSynchronizer(
        [LocalParticipant[CollectiveTrainerRole](VllmPeerTrainer(request.policy), "trainer 0")],
        lambda: dynamo_shards(channel),
        cluster.get_master_address_and_port,
        refit_timeout_s=request.refit_timeout_s,
        options=dataclasses.replace(_OPTIONS, control_timeout_s=channel.control_timeout_s),
    )
