"""refit-core: the tiny interface package of refit.

Importing it loads no torch, zmq, ray, numpy or HTTP library; backends are found through the
``refit.backends`` entry points and imported on first use.
"""

from refit_core.deadline import Deadline
from refit_core.engine_hooks import RefitHooks
from refit_core.errors import (
    AuthenticationError,
    BackendNotInstalledError,
    ChecksumMismatchError,
    EngineReport,
    EngineState,
    GeometryMismatchError,
    ProtocolError,
    Recovery,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
    StaleBaseError,
    SynchronizerClosedError,
    VerificationError,
    WorkerError,
)
from refit_core.factory import create_weight_synchronizer
from refit_core.fleet import EngineHealth, EngineStatus, FleetStatus
from refit_core.registry import SynchronizerRequest
from refit_core.staging import StagedRefit
from refit_core.synchronizer import RecoveryReport, WeightSynchronizer
from refit_core.types import (
    CollectiveSenderSpec,
    NamedTensor,
    RefitResult,
    ShardInfo,
    StateDictInfo,
    TensorSpec,
    WeightVersion,
    WorkerOutcome,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BackendNotInstalledError",
    "ChecksumMismatchError",
    "CollectiveSenderSpec",
    "Deadline",
    "EngineHealth",
    "EngineReport",
    "EngineState",
    "EngineStatus",
    "FleetStatus",
    "GeometryMismatchError",
    "NamedTensor",
    "ProtocolError",
    "Recovery",
    "RecoveryReport",
    "RefitAbortedError",
    "RefitError",
    "RefitHooks",
    "RefitResult",
    "RefitTimeoutError",
    "ShardInfo",
    "StagedRefit",
    "StaleBaseError",
    "StateDictInfo",
    "SynchronizerClosedError",
    "SynchronizerRequest",
    "TensorSpec",
    "VerificationError",
    "WeightSynchronizer",
    "WeightVersion",
    "WorkerError",
    "WorkerOutcome",
    "__version__",
    "create_weight_synchronizer",
]
