"""Refit while serving, on a real vLLM ``AsyncLLM`` (the zmq_sparse row, tensor-parallel 1).

Eight greedy requests stay in flight while the next version is staged (streamed, verified and
held beside the model by the worker's relay; the engine keeps generating) and committed (the
engine pauses in vLLM's ``keep`` mode, writes the held deltas, drops its KV, labels the
version and resumes). Every request then finishes with all its tokens, tagged by vLLM's own
``weight_versions`` with one switch, and its tokens after the switch are exactly what the
engine generates on the new weights when given the same prefix. A failure while staging (a
corrupted payload, a relay cut off mid-transfer) leaves the engine serving its version with no
pause at all: the requests in flight finish exactly as without a refit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from engine_helpers import CheckpointPolicy, Checkpoints, sparse_synchronizer
from inflight_helpers import (
    Served,
    check_requests_cross_a_commit,
    served_as_without_a_refit,
    serving,
)

from refit_core import EngineState, RefitError, WeightSynchronizer
from refit_lab.zmq_faults import CorruptingRelayProxy, PartitioningRelayProxy, ProxiedRelays

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

DEADLINE_S = 60.0
CUT_DEADLINE_S = 10.0  # the refit that loses its relay waits this long


@pytest.fixture(scope="module")
def served(checkpoints: Checkpoints) -> Iterator[Served]:
    from refit_zmq.vllm import engine_args

    with serving(checkpoints.paths["B'"], engine_args()) as engine:
        yield engine


@pytest.fixture(scope="module")
def generation(served: Served) -> Any:
    from refit_zmq.vllm import VllmRelayGeneration

    return VllmRelayGeneration([served.client], relay_timeout_s=20.0)


@pytest.fixture(scope="module")
def partition(generation: Any) -> Iterator[PartitioningRelayProxy]:
    proxy = PartitioningRelayProxy(generation.relay_addresses()[0])
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def corrupt(partition: PartitioningRelayProxy) -> Iterator[CorruptingRelayProxy]:
    proxy = CorruptingRelayProxy(partition.address)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def policy(checkpoints: Checkpoints) -> CheckpointPolicy:
    return CheckpointPolicy(checkpoints, "B'")


@pytest.fixture(scope="module")
def synchronizer(
    generation: Any, corrupt: CorruptingRelayProxy, policy: CheckpointPolicy
) -> Iterator[WeightSynchronizer]:
    with sparse_synchronizer(
        policy, ProxiedRelays(generation, corrupt), DEADLINE_S
    ) as synchronizer:
        synchronizer.sync_weights(1)  # the first refit: a dense resync to the bits it serves
        yield synchronizer


def test_requests_in_flight_cross_a_commit_and_switch_weights_once(
    served: Served, synchronizer: WeightSynchronizer, policy: CheckpointPolicy
) -> None:
    check_requests_cross_a_commit(served, synchronizer, policy, "B''")


def test_a_failure_while_staging_leaves_the_served_version_and_never_pauses(
    served: Served,
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    corrupt: CorruptingRelayProxy,
    partition: PartitioningRelayProxy,
) -> None:
    with served_as_without_a_refit(served, synchronizer):
        policy.state = "B'"
        corrupt.arm()
        with pytest.raises(RefitError, match="checksum") as corrupted:
            synchronizer.stage_weights()
        assert corrupt.corrupted == 1
        assert [e.state for e in corrupted.value.engines] == [EngineState.OLD]

        partition.partition_after(2)  # the relay is cut off mid-transfer, the abort included
        synchronizer.refit_timeout_s = CUT_DEADLINE_S
        started = time.monotonic()
        try:
            with pytest.raises(RefitError) as cut:
                synchronizer.stage_weights()
        finally:
            synchronizer.refit_timeout_s = DEADLINE_S
        assert time.monotonic() - started < CUT_DEADLINE_S + 2.0, "released by the deadline"
        assert cut.value.failed_shards == (0,)
        partition.heal()

    synchronizer.recover()  # the relay that was cut off finishes its transfer; a retry works
    staged = synchronizer.stage_weights()
    synchronizer.commit_weights(staged)
    assert served.client.weight_version() == str(staged.version)
