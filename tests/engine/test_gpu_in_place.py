"""The sparse receiver in a vLLM engine on a GPU (marker ``gpu``: skipped here, where the engine
venv holds the CPU build of torch): unquantized weights are plain tensors there, so every
checkpoint tensor is written in place (no shadow), and a 1 % refit then a failed one leave
exactly what vLLM itself serves on each checkpoint (a fresh engine, and vLLM's own reload)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_helpers import CheckpointPolicy, Checkpoints, Engine, generate, running_engine

from refit_core import RefitError, create_weight_synchronizer
from refit_lab.ray_cluster import LocalCluster
from refit_lab.zmq_faults import CorruptingRelayProxy, ProxiedRelays

pytestmark = [pytest.mark.engine, pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(checkpoints: Checkpoints) -> Iterator[Engine]:
    from refit_zmq.vllm import engine_args

    with running_engine(checkpoints, engine_args(), 1) as running:
        yield running


def test_every_tensor_is_written_in_place_and_refits_equal_vllms_own_load(
    engine: Engine, checkpoints: Checkpoints
) -> None:
    from refit_zmq.vllm import VllmRelayGeneration
    from refit_zmq.vllm.calls import Placement
    from refit_zmq.vllm.engines import call_workers

    generation = VllmRelayGeneration([engine.llm])
    (placement,) = call_workers(engine.llm, "gpu engine", Placement(), 300.0)
    assert placement["shadow_bytes"] == 0 and placement["shadowed"] == [], placement["reasons"]
    proxy = CorruptingRelayProxy(generation.relay_addresses()[0])

    policy = CheckpointPolicy(checkpoints, "B'")
    with create_weight_synchronizer(
        policy,
        ProxiedRelays(generation, proxy),
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_timeout_s=120.0,
        transport="zmq_sparse",
    ) as sync:
        sync.sync_weights()  # a dense resync of what it holds
        policy.state = "B''"
        result = sync.sync_weights()
        assert result.wire_bytes < result.dense_bytes / 4
        assert generate(engine.llm) == engine.expected["B''"]
        policy.state = "B'"
        proxy.arm()
        with pytest.raises(RefitError, match="checksum"):
            sync.sync_weights()
        assert generate(engine.llm) == engine.expected["B''"], "exactly the previous weights"
        sync.sync_weights()
        assert generate(engine.llm) == engine.expected["B'"]
    proxy.close()
