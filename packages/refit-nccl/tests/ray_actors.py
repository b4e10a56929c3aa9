"""Ray actors and fleet for the synchronizer tests (shipped to Ray workers by value)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
import torch

from refit_core.backend import CollectiveSenderSpec
from refit_lab.conformance import EngineWorkerProbes
from refit_lab.digest import state_digest
from refit_lab.reference_engine import (
    GenerationOutput,
    ReferenceEngine,
    ReferenceModelConfig,
    random_checkpoint,
)
from refit_lab.trainer import SimulatedTrainer
from refit_nccl.roles.contract import WorkerRefitStatus
from refit_nccl.roles.engine import EngineEndpoint
from refit_nccl.roles.trainer import TrainerEndpoint
from refit_nccl.transfer.stats import TransferStats


class SlowLoadingEngine(ReferenceEngine):
    """A reference engine whose every ``load_weights`` call takes ``load_delay_s`` longer (a
    refit then lasts long enough to kill a worker in the middle of it), whose every decode
    step takes ``step_delay_s`` longer (a request then spans a refit), and which logs its
    refit hooks with the tokens generated so far when each was called."""

    load_delay_s = 0.0
    step_delay_s = 0.0

    def __init__(self, config: ReferenceModelConfig, seed: int) -> None:
        super().__init__(config, seed=seed)
        self.hooks: list[tuple[str, int, int]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        time.sleep(self.load_delay_s)
        return super().load_weights(weights)

    def _advance(self, request: Any, version: int) -> None:
        time.sleep(self.step_delay_s)
        super()._advance(request, version)

    def on_refit_begin(self, version: int) -> None:
        super().on_refit_begin(version)
        self.hooks.append(("begin", version, self.tokens_generated))

    def on_refit_abort(self, version: int, *, weights_changed: bool) -> None:
        self.hooks.append(("abort", version, self.tokens_generated))
        super().on_refit_abort(version, weights_changed=weights_changed)

    def on_refit_commit(self, version: int) -> None:
        self.hooks.append(("commit", version, self.tokens_generated))
        super().on_refit_commit(version)


class EngineWorker(EngineEndpoint, EngineWorkerProbes):
    """A reference-engine worker with probes. ``reset`` starts over on a fresh engine without
    a new process (each torch import costs seconds on the test machine)."""

    def __init__(
        self, config: ReferenceModelConfig, geometry: CollectiveSenderSpec, seed: int
    ) -> None:
        self._config = config
        super().__init__(lambda: SlowLoadingEngine(config, seed=seed), geometry)
        self.stage_delay_s = 0.0
        self.stages_begun = 0
        self.stages = True

    def refuse_staging(self) -> None:
        """Say in every status that this worker cannot stage (as a vLLM worker does)."""
        self.stages = False

    def refit_status(self) -> WorkerRefitStatus:
        return dataclasses.replace(super().refit_status(), can_stage=self.stages)

    @property
    def slow_engine(self) -> SlowLoadingEngine:
        engine = self.engine
        assert isinstance(engine, SlowLoadingEngine)
        return engine

    def set_load_delay(self, seconds: float) -> None:
        """Make every bucket's load take ``seconds`` longer."""
        self.slow_engine.load_delay_s = seconds

    def set_step_delay(self, seconds: float) -> None:
        """Make every decode step take ``seconds`` longer."""
        self.slow_engine.step_delay_s = seconds

    def set_stage_delay(self, seconds: float) -> None:
        """Make every staging wait ``seconds`` before it receives (a worker that is slow to
        join the transfer, so a test can kill it while the others are in it)."""
        self.stage_delay_s = seconds

    def refit_stage(self, version: int, timeout_s: float | None) -> TransferStats:
        self.stages_begun += 1
        time.sleep(self.stage_delay_s)
        return super().refit_stage(version, timeout_s)

    def staging_begun(self) -> int:
        return self.stages_begun

    def hooks(self) -> list[tuple[str, int, int]]:
        """The engine's refit hooks so far: ``(hook, version, tokens generated then)``."""
        return list(self.slow_engine.hooks)

    def tokens_generated(self) -> int:
        return self.slow_engine.tokens_generated

    def generate_output(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Any:
        """The engine's whole output (tokens and their weight-version spans)."""
        output: GenerationOutput = self.slow_engine.generate(prompts, max_new_tokens)
        return output

    def reset(self, seed: int, geometry: CollectiveSenderSpec | None = None) -> None:
        self.refit_abort("reset")
        self.__init__(self._config, geometry or self.refit_geometry(), seed)  # type: ignore[misc]


class TrainerWorker(TrainerEndpoint):
    """A trainer rank as a Ray actor, holding its own simulated trainer."""

    def __init__(self, config: ReferenceModelConfig, seed: int) -> None:
        self.trainer = SimulatedTrainer(random_checkpoint(config, seed), seed=seed, lr=1e-2)
        self.transfer_delay_s = 0.0
        super().__init__(self.trainer)

    def step(self) -> None:
        self.trainer.step()

    def set_transfer_delay(self, seconds: float) -> None:
        """Make every transfer start ``seconds`` late (the engines wait in theirs)."""
        self.transfer_delay_s = seconds

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        time.sleep(self.transfer_delay_s)
        return super().refit_transfer(
            version, None if timeout_s is None else timeout_s - self.transfer_delay_s
        )

    def engine_digests(self) -> dict[str, int]:
        return state_digest(self.trainer.engine_state().items())


RemoteEngineWorker = ray.remote(EngineWorker)
RemoteTrainerWorker = ray.remote(TrainerWorker)
ACTOR_OPTIONS: dict[str, Any] = {"max_concurrency": 4, "num_cpus": 0}


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

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        return ray.get(getattr(self.workers[index], method).remote(*args), timeout=60)

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
