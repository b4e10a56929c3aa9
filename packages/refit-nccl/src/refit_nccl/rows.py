"""The backend rows refit-nccl implements (read by refit-core's registry; imports nothing heavy)."""

from refit_core.backend import BackendRow

__all__ = ["MEGATRON_COLLECTIVE", "MEGATRON_RESHARD", "VLLM_COLLECTIVE"]

_RENDEZVOUS = ("get_master_address_and_port",)

VLLM_COLLECTIVE = BackendRow(
    backend="vllm",
    topology="non-colocated",
    transport="collective",
    builder="refit_nccl.controller.builder:build_collective_synchronizer",
    description="NCCL collective broadcast of packed buckets",
    on_failure="previous version (staged: default); closed until a complete refit (streamed)",
    default=True,
    options="refit_nccl:CollectiveOptions",
    train_cluster=_RENDEZVOUS,
    can_stage=True,
)

MEGATRON_RESHARD = BackendRow(
    backend="megatron",
    topology="colocated",
    transport="reshard",
    builder="refit_nccl.megatron.builder:build_colocated_reshard",
    description="in-process reshard, training -> inference layout",
    default=True,
)

MEGATRON_COLLECTIVE = BackendRow(
    backend="megatron",
    topology="non-colocated",
    transport="collective",
    builder="refit_nccl.megatron.builder:build_collective_reshard",
    description="reshard over a collective",
    default=True,
    train_cluster=_RENDEZVOUS,
)
