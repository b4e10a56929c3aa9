"""An engine endpoint whose engine keeps what it is handed (vLLM's staged receiver) receives
every transfer on a host group straight into one storage laid out by the plan: the engine keeps
views of it, valid after the transfer, and the next transfer lands in the same memory."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from refit_core.backend import CollectiveSenderSpec, LocalParticipant, Participant
from refit_lab.ray_cluster import free_port
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl import CollectiveWeightSynchronizer, EngineEndpoint, TrainerEndpoint

MiB = 1024 * 1024
CONFIG = ReferenceModelConfig(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=1024)
GEOMETRY = CollectiveSenderSpec("refit", MiB, 2)  # several buckets


class _KeepingEngine(ReferenceEngine):
    """Keeps every tensor it is handed, as handed, and whether they arrived in place."""

    def __init__(self) -> None:
        self.endpoint: EngineEndpoint | None = None  # its own initial load is not recorded
        self.kept: dict[str, torch.Tensor] = {}
        self.in_place: list[bool] = []
        super().__init__(CONFIG, seed=3)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        handed = list(weights)
        if self.endpoint is not None:
            self.in_place.append(self.endpoint.receives_in_place)
            self.kept.update(handed)
        return super().load_weights(handed)


Refit = tuple[dict[str, torch.Tensor], bool, bool]


def _refits(keeps_received: bool, count: int) -> list[Refit]:
    """``count`` refits of a stepping trainer: after each, the tensors the engine kept, whether
    they still hold what was sent, and whether every bucket arrived in place."""
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 1), seed=1, lr=1e-2)
    engine = _KeepingEngine()
    endpoint = EngineEndpoint(lambda: engine, GEOMETRY, "cpu", keeps_received=keeps_received)
    engine.endpoint = endpoint
    port = free_port()
    participants: list[Participant] = [LocalParticipant(endpoint, "shard 0")]
    sync = CollectiveWeightSynchronizer(
        [LocalParticipant(TrainerEndpoint(trainer, device="cpu"), "trainer 0")],
        lambda: {0: participants},
        lambda: ("127.0.0.1", port),
        refit_timeout_s=30.0,
    )
    results = []
    try:
        for _ in range(count):
            trainer.step()
            engine.in_place.clear()
            sync.sync_weights()
            expected = trainer.engine_state()
            assert engine.kept.keys() == expected.keys()
            exact = all(torch.equal(engine.kept[n], t) for n, t in expected.items())
            results.append((dict(engine.kept), exact, all(engine.in_place)))
    finally:
        sync.shutdown()
    return results


@pytest.mark.timeout(120)
def test_an_engine_that_keeps_what_it_is_handed_gets_views_of_one_storage_reused() -> None:
    (first, exact_1, in_place_1), (second, exact_2, in_place_2) = _refits(True, count=2)
    assert in_place_1 and in_place_2
    assert exact_1 and exact_2, "the kept views hold what was sent, after the transfer"
    assert len({t.untyped_storage().data_ptr() for t in first.values()}) > 2, "several buckets"
    # the second transfer landed in the memory of the first (no new copy, no buffers)
    assert all(second[n].data_ptr() == t.data_ptr() for n, t in first.items())


@pytest.mark.timeout(120)
def test_an_engine_that_copies_what_it_is_handed_gets_views_of_reused_buffers() -> None:
    ((_, exact, in_place),) = _refits(False, count=1)
    assert not in_place
    assert not exact, "later buckets reuse the buffers the first ones were handed in"
