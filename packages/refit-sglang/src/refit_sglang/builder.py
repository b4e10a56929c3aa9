"""Entry-point builders of the SGLang rows (``refit.backends``)."""

from __future__ import annotations

import socket
import uuid

from refit_core.backend import LocalParticipant, PolicyLike, RendezvousCluster, SynchronizerRequest
from refit_nccl import CollectiveOptions, CollectiveTrainerRole
from refit_sglang.clients import clients_for
from refit_sglang.colocated import (
    DEFAULT_BUCKET_SIZE_BYTES,
    ColocatedOptions,
    ColocatedSGLangSynchronizer,
    require_bounded,
)
from refit_sglang.disaggregated import SGLangCollectiveSynchronizer
from refit_sglang.participants import EngineSettings, sglang_shards
from refit_sglang.sources import BucketSource
from refit_sglang.trainer import SGLangPeerTrainer

__all__ = ["build_colocated_synchronizer", "build_disaggregated_synchronizer"]

_CONTROL_TIMEOUT_S = 60.0


def _policy(request: SynchronizerRequest) -> PolicyLike:
    if not isinstance(request.policy, PolicyLike):
        raise ValueError("policy must provide weight_source()")
    return request.policy


def build_colocated_synchronizer(request: SynchronizerRequest) -> ColocatedSGLangSynchronizer:
    """The factory's builder for (sglang, colocated, ray_ipc).

    ``generation`` is an SGLang server URL, an ``sglang.Engine``-like object, an
    ``SGLangClient`` or a sequence of these; ``policy`` a ``PolicyLike`` in this process or a
    ``BucketSource`` (trainer ranks as Ray actors: ``RayTrainerRanks``); ``options`` a
    :class:`ColocatedOptions`.

    Raises:
        ValueError: a wrong policy or generation, a deadline with in-process engines, or
            options whose bucket size disagrees with ``refit_buffer_size_gb``.
        UnsupportedEngineError: an in-process engine that lacks a route or field refit needs.
    """
    options = request.with_buffer_size(
        request.options_as(ColocatedOptions) or ColocatedOptions(), "bucket_size_bytes"
    )
    source = request.policy if isinstance(request.policy, BucketSource) else _policy(request)
    return ColocatedSGLangSynchronizer(
        source,
        clients_for(request.generation),
        refit_timeout_s=request.refit_timeout_s,
        options=options,
    )


def build_disaggregated_synchronizer(request: SynchronizerRequest) -> SGLangCollectiveSynchronizer:
    """The factory's builder for (sglang, non-colocated, collective).

    Trainer rank 0 (``policy``, in this process) hosts each weight-update group; the engines
    join through ``init_weights_update_group``. ``train_cluster`` gives each group's
    rendezvous; without one the group meets on 127.0.0.1 (engines on this host only).
    The synchronizer closes the engines' clients at shutdown. ``refit_timeout_s`` bounds
    every trainer-side call; refit cannot abort the group inside an
    SGLang process, so a refit past its deadline names the engines that may be wedged.

    Raises:
        ValueError: a wrong policy or generation, or a deadline with in-process engines.
        UnsupportedEngineError: an in-process engine that lacks a route or field refit needs.
    """
    policy = _policy(request)
    clients = clients_for(request.generation)
    deadline_s = request.refit_timeout_s
    settings = EngineSettings(
        request.refit_buffer_size_bytes or DEFAULT_BUCKET_SIZE_BYTES,
        "abort",
        _CONTROL_TIMEOUT_S if deadline_s is None else max(_CONTROL_TIMEOUT_S, 2 * deadline_s),
    )
    if deadline_s is not None:
        require_bounded(clients)
    cluster = request.train_cluster
    rendezvous = (
        cluster.get_master_address_and_port if isinstance(cluster, RendezvousCluster) else _loopback
    )
    shards = sglang_shards(clients, settings)
    return SGLangCollectiveSynchronizer(
        clients,
        [LocalParticipant[CollectiveTrainerRole](SGLangPeerTrainer(policy), "trainer 0")],
        lambda: shards,
        rendezvous,
        refit_timeout_s=deadline_s,
        options=CollectiveOptions(
            control_timeout_s=settings.control_timeout_s,
            # SGLang keeps a group by name until it is destroyed and refuses a second one of
            # that name: a trainer restarted against a server whose old group was never
            # destroyed (a crash, an engine that stayed wedged) must not reuse the name.
            group_name=f"refit-sglang-{uuid.uuid4().hex[:12]}",
        ),
    )


def _loopback() -> tuple[str, int]:
    """127.0.0.1 and a port free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(probe.getsockname()[1])
