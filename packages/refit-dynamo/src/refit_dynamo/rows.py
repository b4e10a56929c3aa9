"""The backend row refit-dynamo implements (read by refit-core's registry)."""

from refit_core.backend import BackendRow

__all__ = ["DYNAMO_COLLECTIVE"]

DYNAMO_COLLECTIVE = BackendRow(
    backend="dynamo",
    topology="non-colocated",
    transport="collective",
    builder="refit_dynamo.builder:build_dynamo_synchronizer",
    description="Dynamo admin HTTP routes + NCCL broadcast",
    default=True,
    train_cluster=("get_master_address_and_port",),
)
