"""Unmodified vLLM engines on vLLM's own NCCL weight transfer, as collective participants.

An engine started with ``weight_transfer_config={"backend": "nccl"}`` runs vLLM's
``NCCLWeightTransferEngine`` and needs no refit code: the controller drives it through vLLM's
weight-sync surface (the four methods of vLLM's ``VLLMWeightSyncClient``:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). vLLM's own clients fit (``HTTPVLLMWeightSyncClient`` for a server,
``RayVLLMWeightSyncClient`` for engine actors); :class:`LLMWeightSyncClient` adapts an
in-process ``vllm.LLM``. The trainer is :class:`~refit_nccl.vllm_native.trainer.VllmPeerTrainer`, which
hosts the group with vLLM's rendezvous and vLLM's ``PyNcclCommunicator``.

Each engine rank is one participant (ranks ``rank_offset .. rank_offset + engine_world_size``;
vLLM numbers them ``dp_rank * TP * PP + rank``); local rank 0 makes the engine's calls, each on
a thread of its own, and the other ranks answer at once. A refit on rank 0 is
``start_weight_update``, ``update_weights`` (received while the trainer broadcasts) and
``finish_weight_update`` with the version; the commit resets the prefix cache where the client
can. refit cannot abort the communicator inside the engine: past the deadline the trainer's
side is aborted and the engines that did not answer are named as possibly wedged.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec, LocalParticipant, Participant, PolicyLike
from refit_nccl.group.devices import DeviceReport
from refit_nccl.peers.driven import DrivenRankEndpoint, DrivenRankParticipant
from refit_nccl.roles.contract import CollectiveEngineRole, CollectiveTrainerRole, JoinRequest
from refit_nccl.transfer.geometry import VLLM_DOCUMENTED_GEOMETRY, require_vllm_defaults
from refit_nccl.vllm_native.payloads import nccl_init_info, nccl_update_info
from refit_nccl.vllm_native.trainer import VllmPeerTrainer

__all__ = [
    "LLMWeightSyncClient",
    "VllmNativeEndpoint",
    "VllmNativeGeneration",
    "VllmNativeParticipant",
    "WeightSyncClient",
]


@runtime_checkable
class WeightSyncClient(Protocol):
    """vLLM's weight-sync surface (``VLLMWeightSyncClient`` in
    ``vllm/distributed/weight_transfer/base.py``)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class LLMWeightSyncClient:
    """An in-process ``vllm.LLM`` as a :class:`WeightSyncClient` (its methods take the
    request dicts ``{"init_info": ...}`` / ``{"update_info": ...}``)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self._llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self._llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache computed with older weights."""
        self._llm.reset_prefix_cache()


def vllm_geometry() -> CollectiveSenderSpec:
    """vLLM's packing geometry, checked against the installed vLLM where it imports."""
    return require_vllm_defaults(VLLM_DOCUMENTED_GEOMETRY)


class VllmNativeEndpoint(DrivenRankEndpoint):
    """Engine rank ``local_rank`` of the vLLM engine behind ``client``, playing the engine
    role through vLLM's weight-sync surface (run by :class:`VllmNativeParticipant`).

    Args:
        client: the engine's weight-sync surface.
        label: how errors name the engine.
        local_rank: this rank within the engine.
        geometry: vLLM's packing geometry (told to the engine in its init info).
    """

    engines = "a vLLM engine"

    def __init__(
        self,
        client: WeightSyncClient,
        label: str,
        local_rank: int,
        geometry: CollectiveSenderSpec,
    ) -> None:
        super().__init__(label, local_rank, geometry)
        self._client = client
        self._update_info: dict[str, Any] | None = None

    def _engine_key(self) -> Hashable:
        return id(self._client)

    def _device_report(self) -> DeviceReport:
        # vLLM's NCCL receiver moves CUDA tensors over NCCL and nothing else.
        return DeviceReport.only("cuda")

    def _join_engine(self, request: JoinRequest) -> None:
        group = request.group
        if group.backend != "nccl":
            raise GeometryMismatchError(
                f"{self.label}: vLLM's NCCL receiver joins an nccl group, not {group.backend}"
            )
        self._update_info = nccl_update_info(dict(request.state), self._geometry)
        self._client.init_weight_transfer_engine(
            nccl_init_info(group.host, group.port, group.rank, group.world_size, self._geometry)
        )

    def _update_engine(self, version: int) -> None:
        """start, update (the engine receives the broadcast), finish: a failed step stops
        the update before the finish, so vLLM never finalizes a partial load."""
        if self._update_info is None:
            raise RuntimeError(f"{self.label}: no update info; join first")
        self._client.start_weight_update()
        self._client.update_weights(self._update_info)
        self._client.finish_weight_update(str(version))

    def _commit_engine(self, version: int) -> None:
        reset = getattr(self._client, "reset_prefix_cache", None)
        if reset is not None:
            reset()


class VllmNativeParticipant(DrivenRankParticipant):
    """A :class:`VllmNativeEndpoint` as the controller reaches it (each call on a thread)."""

    def __init__(
        self,
        client: WeightSyncClient,
        label: str,
        local_rank: int,
        geometry: CollectiveSenderSpec,
    ) -> None:
        super().__init__(VllmNativeEndpoint(client, label, local_rank, geometry))


class VllmNativeGeneration:
    """Unmodified vLLM engines on vLLM's NCCL weight transfer, as the collective row's
    ``generation``: shard ``i`` is engine ``i`` with ``engine_world_size`` ranks.

    Args:
        clients: each engine's weight-sync surface, in shard order (vLLM's own clients, or
            :class:`LLMWeightSyncClient`).
        engine_world_size: ranks per engine (its TP x PP x DP size).
    """

    def __init__(self, clients: Sequence[WeightSyncClient], *, engine_world_size: int = 1) -> None:
        if not clients:
            raise ValueError("need at least one engine")
        if engine_world_size < 1:
            raise ValueError(f"engine_world_size must be >= 1, got {engine_world_size}")
        geometry = vllm_geometry()
        self._shards: dict[int, list[Participant[CollectiveEngineRole]]] = {
            index: [
                VllmNativeParticipant(client, f"vllm engine {index}", rank, geometry)
                for rank in range(engine_world_size)
            ]
            for index, client in enumerate(clients)
        }

    def collective_shards(self) -> Mapping[int, Sequence[Participant[CollectiveEngineRole]]]:
        """Shard index -> its participants (the same objects on every call)."""
        return self._shards

    def collective_trainers_for(
        self, policy: PolicyLike
    ) -> list[Participant[CollectiveTrainerRole]]:
        """The trainer side these engines need: one sender speaking vLLM's protocol."""
        return [LocalParticipant[CollectiveTrainerRole](VllmPeerTrainer(policy), "trainer 0")]
