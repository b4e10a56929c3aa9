"""Ray actors and fleet for the synchronizer tests (shipped to Ray workers by value)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
import torch

from refit_core.backend import CollectiveSenderSpec
from refit_lab.conformance import EngineWorkerProbes
from refit_lab.digest import state_digest
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl.endpoint import EngineEndpoint, TrainerEndpoint


class SlowLoadingEngine(ReferenceEngine):
    """A reference engine whose every ``load_weights`` call takes ``load_delay_s`` longer (a
    refit then lasts long enough to kill a worker in the middle of it)."""

    load_delay_s = 0.0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        time.sleep(self.load_delay_s)
        return super().load_weights(weights)


class EngineWorker(EngineEndpoint, EngineWorkerProbes):
    """A reference-engine worker with probes. ``reset`` starts over on a fresh engine without
    a new process (each torch import costs seconds on the test machine)."""

    def __init__(
        self, config: ReferenceModelConfig, geometry: CollectiveSenderSpec, seed: int
    ) -> None:
        self._config = config
        super().__init__(lambda: SlowLoadingEngine(config, seed=seed), geometry)

    def set_load_delay(self, seconds: float) -> None:
        """Make every bucket's load take ``seconds`` longer."""
        engine = self.engine
        assert isinstance(engine, SlowLoadingEngine)
        engine.load_delay_s = seconds

    def reset(self, seed: int, geometry: CollectiveSenderSpec | None = None) -> None:
        self.refit_abort("reset")
        self.__init__(self._config, geometry or self.refit_geometry(), seed)  # type: ignore[misc]


class TrainerWorker(TrainerEndpoint):
    """A trainer rank as a Ray actor, holding its own simulated trainer."""

    def __init__(self, config: ReferenceModelConfig, seed: int) -> None:
        self.trainer = SimulatedTrainer(random_checkpoint(config, seed), seed=seed, lr=1e-2)
        super().__init__(self.trainer)

    def step(self) -> None:
        self.trainer.step()

    def engine_digests(self) -> dict[str, int]:
        return state_digest(self.trainer.engine_state().items())


RemoteEngineWorker = ray.remote(EngineWorker)
RemoteTrainerWorker = ray.remote(TrainerWorker)
ACTOR_OPTIONS: dict[str, Any] = {"max_concurrency": 3, "num_cpus": 0}


class Fleet:
    """Engine shards of one worker each, as a ``CollectiveGeneration``; shards can be restarted."""

    def __init__(
        self, config: ReferenceModelConfig, geometry: CollectiveSenderSpec, shards: int
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.workers: dict[int, Any] = {i: self._start(i + 100) for i in range(shards)}

    def _start(self, seed: int) -> Any:
        return RemoteEngineWorker.options(**ACTOR_OPTIONS).remote(self.config, self.geometry, seed)

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        return {index: [worker] for index, worker in self.workers.items()}

    def reset(self, seed: int, geometry: CollectiveSenderSpec | None = None) -> None:
        ray.get([w.reset.remote(seed + i, geometry) for i, w in self.workers.items()], timeout=60)

    def restart(self, index: int, seed: int) -> None:
        """Replace shard ``index`` by a fresh worker process; returns once it is up."""
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._start(seed)
        ray.get(self.workers[index].pid.remote(), timeout=120)

    def call(self, method: str, *args: Any) -> list[Any]:
        return ray.get(
            [getattr(w, method).remote(*args) for w in self.workers.values()], timeout=60
        )

    def close(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker, no_restart=True)
