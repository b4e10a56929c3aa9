"""refit-dynamo: refit a fleet of NVIDIA Dynamo vLLM workers over their admin HTTP routes.

The names import their HTTP client on first use, so ``import refit_dynamo`` (and reading its
row) stays light.
"""

from importlib import metadata
from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

if TYPE_CHECKING:
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
else:
    __getattr__ = lazy_facade(
        __name__,
        (
            "refit_dynamo.admin",
            "refit_dynamo.channel",
            "refit_dynamo.endpoint",
            "refit_dynamo.errors",
            "refit_dynamo.geometry",
        ),
    )

__version__ = metadata.version("refit-dynamo")

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
