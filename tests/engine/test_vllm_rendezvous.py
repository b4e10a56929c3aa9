"""refit's vLLM peer (``VllmPeerTrainer``, ``GroupSpec(rendezvous="vllm")``) against vLLM's own
stateless group and packed consumer, imported from the installed vLLM (0.32.0, CPU).

vLLM's weight-transfer receiver (``NCCLWeightTransferEngine``) is NCCL-only, so the receivers
here are vLLM's gloo stateless group plus vLLM's packed consumer (``vllm_peer_ranks.py``
says what is stood in). Checked: the rendezvous and warm-up, a bitwise packed transfer whose
bucket boundaries are vLLM's, the geometry default of the installed vLLM, and refit's
deadline (a transfer the receivers never join ends in ``RefitTimeoutError`` by the deadline
+ 1 s, and the group refuses calls after it).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
from vllm_peer_ranks import (
    BUFFER_BYTES,
    NUM_BUFFERS,
    check_a_transfer_nobody_joins_ends_by_the_deadline,
    peer_state,
    vllm_receiver,
)

from refit_core.backend import CollectiveSenderSpec
from refit_core.sources import StateDictSource
from refit_lab.ray_cluster import free_port
from refit_nccl.backend import (
    GroupSpec,
    JoinRequest,
    TransferPlan,
    VllmPeerTrainer,
    installed_vllm_geometry,
)

pytestmark = pytest.mark.engine

SEED = 7
RECEIVERS = 2
DEADLINE_S = 2.0


class _Policy:
    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self._state)


def test_installed_vllm_geometry_is_the_documented_default() -> None:
    assert installed_vllm_geometry() == CollectiveSenderSpec("vllm", 1 << 30, 2)


@pytest.mark.timeout(400)
def test_vllm_receivers_join_refits_vllm_rendezvous_and_receive_bitwise() -> None:
    pytest.importorskip("vllm")
    state = peer_state(SEED)
    trainer = VllmPeerTrainer(_Policy(state))
    geometry = CollectiveSenderSpec("vllm", BUFFER_BYTES, NUM_BUFFERS)
    port, world = free_port(), 1 + RECEIVERS
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    receivers = [
        context.Process(
            target=vllm_receiver, args=(results, "127.0.0.1", port, rank, world, SEED), daemon=True
        )
        for rank in range(1, world)
    ]
    try:
        for process in receivers:
            process.start()
        items = trainer.refit_state()
        request = JoinRequest(
            GroupSpec("127.0.0.1", port, 0, world, "gloo", "t"), items, geometry, 240.0
        )
        trainer.refit_join(request)
        joined = [results.get(timeout=60) for _ in range(RECEIVERS)]
        assert sorted(r["rank"] for r in joined) == [1, 2]
        assert all(r["event"] == "joined" and r["warm_up"] == 0.0 for r in joined)

        stats = trainer.refit_transfer(1, 120.0)
        received = [results.get(timeout=120) for _ in range(RECEIVERS)]
        plan = TransferPlan.build(dict(items), geometry)
        assert stats.buckets == len(plan.buckets) > 2
        for report in received:
            assert report["event"] == "received" and report["wrong"] == [], report
            assert report["sizes"] == [bucket.nbytes for bucket in plan.buckets]

        check_a_transfer_nobody_joins_ends_by_the_deadline(trainer, DEADLINE_S)
    finally:
        trainer.refit_abort("test done")
        for process in receivers:
            process.kill()
            process.join(10)
