"""The toy rows' builders: what ``create_weight_synchronizer`` calls."""

from __future__ import annotations

from refit_core.backend import RendezvousCluster, SynchronizerRequest
from refit_toy.synchronizer import ToyEngine, ToyOptions, ToyPolicy, ToySynchronizer


def _parts(request: SynchronizerRequest) -> tuple[ToyPolicy, ToyEngine, ToyOptions]:
    if not isinstance(request.policy, ToyPolicy) or not isinstance(request.generation, ToyEngine):
        raise ValueError("the toy rows take a ToyPolicy and a ToyEngine")
    return request.policy, request.generation, request.options_as(ToyOptions) or ToyOptions()


def build_memory(request: SynchronizerRequest) -> ToySynchronizer:
    """``toy.colocated.memory``."""
    policy, engine, options = _parts(request)
    return ToySynchronizer(policy, engine, options, None, request.refit_timeout_s)


def build_wire(request: SynchronizerRequest) -> ToySynchronizer:
    """``toy.non-colocated.wire``: meets where ``train_cluster`` says."""
    policy, engine, options = _parts(request)
    cluster = request.train_cluster
    if not isinstance(cluster, RendezvousCluster):
        raise ValueError("train_cluster must provide get_master_address_and_port()")
    meeting = cluster.get_master_address_and_port()
    return ToySynchronizer(policy, engine, options, meeting, request.refit_timeout_s)
