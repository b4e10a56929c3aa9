"""refit-nccl's interface for packages that build on it (refit-sglang, refit-dynamo).

Process groups whose calls end by a deadline, the packed broadcast and its plan, group
membership, the join handshake, and the trainer side for engines that join refit's group
through their own protocol, and engine ranks refit drives through the engine's own calls
(``DrivenRankEndpoint``). Everything else in ``refit_nccl`` is internal.
"""

from refit_nccl.backends import Backend
from refit_nccl.broadcast import Consumer, TransferStats, receive_packed, send_packed
from refit_nccl.child import ChildProcessGroup
from refit_nccl.devices import DeviceReport, DeviceType, choose_backend
from refit_nccl.driven import DrivenRankEndpoint, DrivenRankParticipant
from refit_nccl.geometry import DEFAULT_GEOMETRY, installed_vllm_geometry, require_vllm_defaults
from refit_nccl.group import AbortableProcessGroup, GroupSpec, PendingCall
from refit_nccl.handshake import agree_on_plan
from refit_nccl.membership import Membership, ShardRanks, plan_membership
from refit_nccl.peer import PeerTrainer
from refit_nccl.plan import Bucket, Slot, TransferPlan
from refit_nccl.roles import JoinRequest, StateItems
from refit_nccl.storage import PlanStorage, StagingBuffers
from refit_nccl.synchronizer import ShardMap
from refit_nccl.vllm_peer import VllmPeerTrainer

__all__ = [
    "DEFAULT_GEOMETRY",
    "AbortableProcessGroup",
    "Backend",
    "Bucket",
    "ChildProcessGroup",
    "Consumer",
    "DeviceReport",
    "DeviceType",
    "DrivenRankEndpoint",
    "DrivenRankParticipant",
    "GroupSpec",
    "JoinRequest",
    "Membership",
    "PeerTrainer",
    "PendingCall",
    "PlanStorage",
    "ShardMap",
    "ShardRanks",
    "Slot",
    "StagingBuffers",
    "StateItems",
    "TransferPlan",
    "TransferStats",
    "VllmPeerTrainer",
    "agree_on_plan",
    "choose_backend",
    "installed_vllm_geometry",
    "plan_membership",
    "receive_packed",
    "require_vllm_defaults",
    "send_packed",
]
