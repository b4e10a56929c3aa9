"""The toy backend's rows: what refit-core reads to list and pick them (nothing heavy here)."""

from refit_core.backend import BackendRow

ON_FAILURE = "exactly its previous version: the engine takes the new bytes only once all arrived"

MEMORY = BackendRow(
    backend="toy",
    topology="colocated",
    transport="memory",
    builder="refit_toy.builder:build_memory",
    description="copies the trainer's bytes into an engine in the same process",
    default=True,
    options="refit_toy:ToyOptions",
    on_failure=ON_FAILURE,
)

WIRE = BackendRow(
    backend="toy",
    topology="non-colocated",
    transport="wire",
    builder="refit_toy.builder:build_wire",
    description="the same copy, after asking train_cluster where to meet",
    default=True,
    options="refit_toy:ToyOptions",
    train_cluster=("get_master_address_and_port",),
    on_failure=ON_FAILURE,
)
