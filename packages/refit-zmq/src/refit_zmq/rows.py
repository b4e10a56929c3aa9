"""The backend rows refit-zmq implements (read by refit-core's registry; imports nothing heavy)."""

from refit_core.backend import BackendRow, Topology

__all__ = ["VLLM_IPC", "VLLM_LORA_COLOCATED", "VLLM_LORA_NON_COLOCATED", "VLLM_ZMQ_SPARSE"]

VLLM_IPC = BackendRow(
    backend="vllm",
    topology="colocated",
    transport="ipc",
    builder="refit_zmq.ipc.builder:build_ipc_synchronizer",
    description="ZMQ control + CUDA IPC handles (shared memory on CPU)",
    on_failure="previous version (staged: default); closed until a complete refit (streamed)",
    default=True,
    options="refit_zmq.ipc:IpcOptions",
)

VLLM_ZMQ_SPARSE = BackendRow(
    backend="vllm",
    topology="non-colocated",
    transport="zmq_sparse",
    builder="refit_zmq.sparse.builder:build_zmq_sparse_synchronizer",
    description="sparse deltas over the transactional ZMQ relay tree",
    on_failure=(
        "previous version, bit for bit; closed until a complete refit if loading a committed "
        "delta into the model fails"
    ),
    options="refit_zmq.sparse:ZmqSparseOptions",
    can_stage=True,
)


def _lora_row(topology: Topology) -> BackendRow:
    return BackendRow(
        backend="vllm",
        topology=topology,
        transport="lora",
        builder="refit_zmq.lora.builder:build_lora_synchronizer",
        description=(
            "one LoRA adapter from memory, each version beside the last (delta-coded over the "
            "engine's RPC)"
        ),
        on_failure="previous version of the adapter (the new one is dropped everywhere)",
        options="refit_zmq.lora:LoraOptions",
        model_kinds=("lora",),
    )


VLLM_LORA_COLOCATED = _lora_row("colocated")
VLLM_LORA_NON_COLOCATED = _lora_row("non-colocated")
