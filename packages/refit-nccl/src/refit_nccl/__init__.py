"""refit-nccl: abortable process groups, packed pipelined broadcast and the collective
synchronizer behind ``create_weight_synchronizer(..., "vllm", colocated=False)``."""

from refit_core.participants import ActorParticipant, LocalParticipant, Participant
from refit_nccl.backends import Backend
from refit_nccl.broadcast import Consumer, TransferStats, receive_packed, send_packed
from refit_nccl.builder import CollectiveGeneration, CollectivePolicy, build_collective_synchronizer
from refit_nccl.child import ChildProcessGroup
from refit_nccl.devices import DeviceMismatchError, DeviceReport, choose_backend
from refit_nccl.endpoint import (
    CollectiveEngine,
    EngineEndpoint,
    EngineStatus,
    JoinRequest,
    TrainerEndpoint,
)
from refit_nccl.geometry import DEFAULT_GEOMETRY, installed_vllm_geometry, require_vllm_defaults
from refit_nccl.group import AbortableProcessGroup, GroupSpec, PendingCall
from refit_nccl.handshake import agree_on_plan
from refit_nccl.membership import Membership, ShardRanks, plan_membership
from refit_nccl.plan import Bucket, Slot, TransferPlan
from refit_nccl.storage import PlanStorage, StagingBuffers
from refit_nccl.synchronizer import CollectiveOptions, CollectiveWeightSynchronizer
from refit_nccl.vllm_native.engine import LLMWeightSyncClient, VllmNativeGeneration
from refit_nccl.vllm_peer import VllmPeerTrainer

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_GEOMETRY",
    "AbortableProcessGroup",
    "ActorParticipant",
    "Backend",
    "Bucket",
    "ChildProcessGroup",
    "CollectiveEngine",
    "CollectiveGeneration",
    "CollectiveOptions",
    "CollectivePolicy",
    "CollectiveWeightSynchronizer",
    "Consumer",
    "DeviceMismatchError",
    "DeviceReport",
    "EngineEndpoint",
    "EngineStatus",
    "GroupSpec",
    "JoinRequest",
    "LLMWeightSyncClient",
    "LocalParticipant",
    "Membership",
    "Participant",
    "PendingCall",
    "PlanStorage",
    "ShardRanks",
    "Slot",
    "StagingBuffers",
    "TrainerEndpoint",
    "TransferPlan",
    "TransferStats",
    "VllmNativeGeneration",
    "VllmPeerTrainer",
    "__version__",
    "agree_on_plan",
    "build_collective_synchronizer",
    "choose_backend",
    "installed_vllm_geometry",
    "plan_membership",
    "receive_packed",
    "require_vllm_defaults",
    "send_packed",
]
