"""refit-dynamo: refit a fleet of NVIDIA Dynamo vLLM workers over their admin HTTP routes."""

from refit_dynamo.admin import AdminClient
from refit_dynamo.channel import DynamoRefitChannel, WorkerValidator
from refit_dynamo.endpoint import DynamoWorkerEndpoint
from refit_dynamo.errors import (
    DynamoFleetError,
    DynamoWorkerError,
    DynamoWorkerTimeoutError,
    FleetChangedError,
)
from refit_dynamo.geometry import VLLM_SENDER_SPEC

__version__ = "0.1.0"

__all__ = [
    "VLLM_SENDER_SPEC",
    "AdminClient",
    "DynamoFleetError",
    "DynamoRefitChannel",
    "DynamoWorkerEndpoint",
    "DynamoWorkerError",
    "DynamoWorkerTimeoutError",
    "FleetChangedError",
    "WorkerValidator",
    "__version__",
]
