"""The conformance suite, run against an in-process synchronizer into reference engines.

The suite passes for a correct synchronizer and catches one that forgets to invalidate the
engines' prefix caches or that drops a tensor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from refit_core import RefitResult, WeightSynchronizer, WorkerOutcome
from refit_core.backend import Deadline
from refit_lab.conformance import (
    RefitDeployment,
    SynchronizerConformance,
    check_bitwise_delivery,
    check_generation_matches_trainer,
)
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer

CONFIG = ReferenceModelConfig()


class InProcessSynchronizer(WeightSynchronizer):
    """Copies the trainer's source straight into engines in this process."""

    def __init__(
        self,
        trainer: SimulatedTrainer,
        engines: Sequence[ReferenceEngine],
        *,
        reset_cache: bool = True,
        skip: str | None = None,
    ) -> None:
        super().__init__()
        self._trainer = trainer
        self._engines = engines
        self._reset_cache = reset_cache
        self._skip = skip

    def _init_communicator(self, deadline: Deadline) -> None:
        return None

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        started = time.monotonic()
        dense = 0
        for engine in self._engines:
            tensors = [
                (t.name, t.tensor)
                for t in self._trainer.weight_source().iter_tensors()
                if t.name != self._skip
            ]
            engine.load_weights(tensors)
            dense = sum(t.numel() * t.element_size() for _, t in tensors)
            if self._reset_cache:
                engine.reset_prefix_cache()
            engine.set_weight_version(version)
        workers = tuple(
            WorkerOutcome(f"engine{i}", True, version) for i in range(len(self._engines))
        )
        elapsed = time.monotonic() - started
        return RefitResult(version, {"load": elapsed}, elapsed, dense, dense, workers)

    def _shutdown(self) -> None:
        return None


@dataclass
class InProcessDeployment(RefitDeployment):
    engines: Sequence[ReferenceEngine] = ()

    def engine_digests(self) -> list[dict[str, int]]:
        return [e.state_digests() for e in self.engines]

    def engine_versions(self) -> list[int]:
        return [e.weight_version for e in self.engines]

    def engine_generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[list[int]]]:
        return [e.generate(prompts, max_new_tokens).tokens for e in self.engines]


def make_deployment(**kwargs: object) -> InProcessDeployment:
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, seed=1), lr=1e-2)
    engines = [ReferenceEngine(CONFIG, seed=2) for _ in range(2)]
    sync = InProcessSynchronizer(trainer, engines, **kwargs)  # type: ignore[arg-type]
    return InProcessDeployment(trainer=trainer, synchronizer=sync, config=CONFIG, engines=engines)


class TestInProcessConformance(SynchronizerConformance):
    def create_deployment(self) -> RefitDeployment:
        return make_deployment()


def test_suite_catches_a_forgotten_cache_invalidation() -> None:
    deployment = make_deployment(reset_cache=False)
    with pytest.raises(AssertionError, match="generated"):
        check_generation_matches_trainer(deployment)


def test_suite_catches_a_dropped_tensor() -> None:
    deployment = make_deployment(skip="model.norm.weight")
    with pytest.raises(AssertionError, match=r"model\.norm\.weight"):
        check_bitwise_delivery(deployment)
