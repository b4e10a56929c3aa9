"""refit-nccl: the collective synchronizer behind ``create_weight_synchronizer(..., "vllm",
colocated=False)``, and what a deployment runs beside it.

This module is the user API: the synchronizer's options, the endpoints a trainer rank or
engine worker runs (as Ray actors or inside a framework's own workers), the roles they play,
and the protocols of the objects handed to the factory. Packages that build on refit-nccl's
process groups and packed broadcast (refit-sglang, refit-dynamo) use
:mod:`refit_nccl.backend`. The names import torch on first use, so ``import refit_nccl``
(and reading its rows) stays light.
"""

from importlib import metadata
from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

if TYPE_CHECKING:
    from refit_nccl.builder import CollectiveGeneration, CollectivePolicy, PeerGeneration
    from refit_nccl.devices import DeviceMismatchError
    from refit_nccl.endpoint import (
        CollectiveEngine,
        CommitStats,
        EngineEndpoint,
        EngineStatus,
        TrainerEndpoint,
    )
    from refit_nccl.roles import (
        CollectiveEngineRole,
        CollectiveMemberRole,
        CollectiveStagingRole,
        CollectiveTrainerRole,
    )
    from refit_nccl.synchronizer import CollectiveOptions, CollectiveWeightSynchronizer
    from refit_nccl.vllm_native.engine import LLMWeightSyncClient, VllmNativeGeneration
else:
    __getattr__ = lazy_facade(
        __name__,
        (
            "refit_nccl.builder",
            "refit_nccl.devices",
            "refit_nccl.endpoint",
            "refit_nccl.roles",
            "refit_nccl.synchronizer",
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
    "EngineStatus",
    "LLMWeightSyncClient",
    "PeerGeneration",
    "TrainerEndpoint",
    "VllmNativeGeneration",
    "__version__",
]
