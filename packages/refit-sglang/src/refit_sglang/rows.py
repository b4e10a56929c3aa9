"""The backend rows refit-sglang implements (read by refit-core's registry)."""

from refit_core.backend import BackendRow

__all__ = ["SGLANG_COLLECTIVE", "SGLANG_RAY_IPC"]

SGLANG_RAY_IPC = BackendRow(
    backend="sglang",
    topology="colocated",
    transport="ray_ipc",
    builder="refit_sglang.builder:build_colocated_synchronizer",
    description="Ray CUDA-IPC transfer of flattened buckets",
    default=True,
    options="refit_sglang:ColocatedOptions",
)

SGLANG_COLLECTIVE = BackendRow(
    backend="sglang",
    topology="non-colocated",
    transport="collective",
    builder="refit_sglang.builder:build_disaggregated_synchronizer",
    description="NCCL broadcast over SGLang's weight-update group (train_cluster optional)",
    default=True,
)
