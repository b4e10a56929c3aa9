"""refit-nccl's interface for packages that build on it (refit-sglang, refit-dynamo).

Process groups whose calls end by a deadline, the packed broadcast and its plan, group
membership, the join handshake, and the trainer side for engines that join refit's group
through their own protocol, and engine ranks refit drives through the engine's own calls
(``DrivenRankEndpoint``). Everything else in ``refit_nccl`` is internal.
"""

from refit_nccl.controller.membership import Membership, ShardRanks, plan_membership
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.calls import PendingCall
from refit_nccl.group.child.process_group import ChildProcessGroup
from refit_nccl.group.devices import DeviceReport, DeviceType, choose_backend
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Backend
from refit_nccl.peers.driven import DrivenRankEndpoint, DrivenRankParticipant
from refit_nccl.peers.trainer import PeerTrainer
from refit_nccl.roles.contract import JoinRequest, ShardMap, StateItems
from refit_nccl.transfer.broadcast import Consumer, receive_packed, send_packed
from refit_nccl.transfer.geometry import (
    DEFAULT_GEOMETRY,
    installed_vllm_geometry,
    require_vllm_defaults,
)
from refit_nccl.transfer.handshake import agree_on_plan
from refit_nccl.transfer.plan import PackedBucket, Slot, TransferPlan
from refit_nccl.transfer.stats import TransferStats
from refit_nccl.transfer.storage import PlanStorage, StagingBuffers
from refit_nccl.vllm_native.trainer import VllmPeerTrainer

__all__ = [
    "DEFAULT_GEOMETRY",
    "AbortableProcessGroup",
    "Backend",
    "ChildProcessGroup",
    "Consumer",
    "DeviceReport",
    "DeviceType",
    "DrivenRankEndpoint",
    "DrivenRankParticipant",
    "GroupSpec",
    "JoinRequest",
    "Membership",
    "PackedBucket",
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
