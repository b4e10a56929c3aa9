"""refit-nccl: the collective synchronizer behind ``create_weight_synchronizer(..., "vllm",
colocated=False)``, and what a deployment runs beside it.

This module is the user API: the synchronizer's options, the endpoints a trainer rank or
engine worker runs (as Ray actors or inside a framework's own workers), the roles they play,
and the protocols of the objects handed to the factory. Packages that build on refit-nccl's
process groups and packed broadcast (refit-sglang, refit-dynamo) use
:mod:`refit_nccl.backend`. The names import torch on first use, so ``import refit_nccl``
(and reading its rows) stays light.

The modules are laid out by concern: ``group`` (the abortable process group, its child-process
variant and watchdog), ``transfer`` (what moves through a group: plan, packing, broadcast),
``roles`` (the contract the controller calls and the trainer and engine endpoints),
``controller`` (the synchronizer and its builder), and one folder per engine family:
``vllm`` (refit's receiver inside vLLM workers), ``vllm_native`` (vLLM's own NCCL data plane),
``peers`` (engines that join through their own protocol) and ``megatron``.
"""

from importlib import metadata
from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

if TYPE_CHECKING:
    from refit_nccl.controller.builder import (
        CollectiveGeneration,
        CollectivePolicy,
        PeerGeneration,
    )
    from refit_nccl.controller.options import CollectiveOptions
    from refit_nccl.controller.synchronizer import CollectiveWeightSynchronizer
    from refit_nccl.group.devices import DeviceMismatchError
    from refit_nccl.roles.contract import (
        CollectiveEngineRole,
        CollectiveMemberRole,
        CollectiveStagingRole,
        CollectiveTrainerRole,
        CommitStats,
        WorkerRefitStatus,
    )
    from refit_nccl.roles.engine import CollectiveEngine, EngineEndpoint
    from refit_nccl.roles.trainer import TrainerEndpoint
    from refit_nccl.vllm_native.engine import LLMWeightSyncClient, VllmNativeGeneration
else:
    __getattr__ = lazy_facade(
        __name__,
        (
            "refit_nccl.controller.builder",
            "refit_nccl.controller.options",
            "refit_nccl.controller.synchronizer",
            "refit_nccl.group.devices",
            "refit_nccl.roles.contract",
            "refit_nccl.roles.engine",
            "refit_nccl.roles.trainer",
            "refit_nccl.vllm_native.engine",
        ),
    )

__version__ = metadata.version("refit-nccl")

__all__ = [
    "CollectiveEngine",
    "CollectiveEngineRole",
    "CollectiveGeneration",
    "CollectiveMemberRole",
    "CollectiveOptions",
    "CollectivePolicy",
    "CollectiveStagingRole",
    "CollectiveTrainerRole",
    "CollectiveWeightSynchronizer",
    "CommitStats",
    "DeviceMismatchError",
    "EngineEndpoint",
    "LLMWeightSyncClient",
    "PeerGeneration",
    "TrainerEndpoint",
    "VllmNativeGeneration",
    "WorkerRefitStatus",
    "__version__",
]
