"""refit-core: the tiny interface package of refit.

This module is the user API: the factory, the synchronizer it returns, the errors it raises
and the value types it takes and gives. Backend authors find the rest of what they may use in
:mod:`refit_core.backend`. Importing either loads no torch, zmq, ray, numpy or HTTP library;
backends are found through the ``refit.backends`` entry points and imported on first use.
"""

from importlib import metadata

from refit_core.engine_hooks import RefitHooks
from refit_core.errors import (
    AuthenticationError,
    BackendNotInstalledError,
    ChecksumMismatchError,
    DeadlineTooShortError,
    EngineReport,
    EngineState,
    GeometryMismatchError,
    InvalidTimeoutError,
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
from refit_core.staging import StagedRefit
from refit_core.synchronizer import RecoveryReport, WeightSynchronizer
from refit_core.types import (
    NamedTensor,
    RefitResult,
    ShardInfo,
    StateDictInfo,
    TensorSpec,
    WeightVersion,
    WorkerOutcome,
)

__version__ = metadata.version("refit-core")

__all__ = [
    "AuthenticationError",
    "BackendNotInstalledError",
    "ChecksumMismatchError",
    "DeadlineTooShortError",
    "EngineHealth",
    "EngineReport",
    "EngineState",
    "EngineStatus",
    "FleetStatus",
    "GeometryMismatchError",
    "InvalidTimeoutError",
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
    "TensorSpec",
    "VerificationError",
    "WeightSynchronizer",
    "WeightVersion",
    "WorkerError",
    "WorkerOutcome",
    "__version__",
    "create_weight_synchronizer",
]
