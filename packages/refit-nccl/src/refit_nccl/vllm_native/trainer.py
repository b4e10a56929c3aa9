"""Trainer rank 0 for receivers that speak vLLM's native weight-transfer protocol.

vLLM's receiver (``NCCLWeightTransferEngine`` in vLLM 0.32.0,
``vllm/distributed/weight_transfer/nccl_engine.py``, and whatever drives it, such as a Dynamo
worker) joins from its init info alone (address, port, rank offset, world size) and cuts
buckets from the update info by its packing rule. So this trainer hosts the group with vLLM's
rendezvous (``GroupSpec.rendezvous="vllm"``: vLLM's store keys and one-element zero warm-up,
see :mod:`refit_nccl.group.rendezvous`), runs no plan-digest handshake, and packs by vLLM's rule
(``CollectiveSenderSpec.peer == "vllm"``; check the receiver's geometry with
:func:`refit_nccl.require_vllm_defaults`). On the ``nccl`` backend the group's communicator is
vLLM's own ``PyNcclCommunicator`` (:mod:`refit_nccl.vllm_native`), so a CUDA trainer without
vLLM reports that it cannot join one, and the controller refuses with the install line. Every
call keeps refit's deadline: per-call timeouts or ``ncclCommAbort``, ``RefitTimeoutError``.
"""

from __future__ import annotations

import dataclasses
import logging

from refit_core import GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec, Deadline, PolicyLike
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.devices import DeviceReport, DeviceType, local_device
from refit_nccl.group.spec import GroupSpec
from refit_nccl.peers.trainer import PeerTrainer
from refit_nccl.roles.contract import JoinRequest, StateItems
from refit_nccl.transfer.broadcast import send_packed
from refit_nccl.transfer.plan import TransferPlan
from refit_nccl.transfer.stats import TransferStats
from refit_nccl.transfer.storage import StagingBuffers
from refit_nccl.vllm_native.availability import VLLM_INSTALL_HINT, vllm_nccl_missing

__all__ = ["VllmPeerTrainer"]

logger = logging.getLogger(__name__)


class VllmPeerTrainer(PeerTrainer[TransferPlan]):
    """The sending trainer rank (rank 0) of a refit into vLLM-protocol receivers.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
        device: where the policy's tensors live; None: this process's device.
    """

    engines = "a vLLM-protocol"

    def __init__(self, policy: PolicyLike, device: DeviceType | None = None) -> None:
        super().__init__(policy, device)
        self._staging = StagingBuffers()

    def refit_device(self) -> DeviceReport:
        """On CUDA this trainer joins vLLM's NCCL data plane only where vLLM imports."""
        device = self._device or local_device()
        missing = vllm_nccl_missing() if device == "cuda" else ""
        if missing:
            return DeviceReport.lacking(device, missing, VLLM_INSTALL_HINT)
        return DeviceReport.of(device)

    def _build_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> TransferPlan:
        if geometry.peer != "vllm":
            raise GeometryMismatchError(
                f"a vLLM receiver unpacks by vLLM's rule; the geometry is for peer {geometry.peer!r}"
            )
        return TransferPlan.build(dict(state), geometry)

    def _group_spec(self, request: JoinRequest) -> GroupSpec:
        return dataclasses.replace(request.group, rendezvous="vllm")

    def _send(
        self, group: AbortableProcessGroup, plan: TransferPlan, version: int, deadline: Deadline
    ) -> TransferStats:
        tensors = ((t.name, t.tensor) for t in self._policy.weight_source().iter_tensors())
        stats = send_packed(group, plan, tensors, deadline, staging=self._staging)
        logger.info("sent version %d in %.3f s", version, stats.total_s)
        return stats
