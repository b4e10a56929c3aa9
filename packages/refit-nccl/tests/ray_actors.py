"""Ray actors and fleet for the synchronizer tests (shipped to Ray workers by value)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray

from refit_core.backend import CollectiveSenderSpec
from refit_lab.conformance import EngineWorkerProbes
from refit_lab.digest import state_digest
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl.endpoint import EngineEndpoint, TrainerEndpoint


class EngineWorker(EngineEndpoint, EngineWorkerProbes):
    """A reference-engine worker with probes. ``reset`` starts over on a fresh engine without
    a new process (each torch import costs seconds on the test machine)."""

    def __init__(
        self, config: ReferenceModelConfig, geometry: CollectiveSenderSpec, seed: int
    ) -> None:
        self._config = config
        super().__init__(lambda: ReferenceEngine(config, seed=seed), geometry)

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
