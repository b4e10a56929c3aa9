"""The `inflight` bench's engines: reference engines that log when they generate and pause,
served by refit-nccl's engine endpoint in Ray actors, and the fleet around them.

Imports Ray: import this module only where Ray is installed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from refit_core.backend import CollectiveSenderSpec
from refit_lab.ray_cluster import ActorFleet
from refit_lab.reference_engine import GenerationOutput, ReferenceEngine, ReferenceModelConfig
from refit_nccl import EngineEndpoint

__all__ = ["EngineTimeline", "InflightFleet", "InflightWorker", "PauseSpan", "TimedEngine"]

_ACTOR_OPTIONS: dict[str, Any] = {"max_concurrency": 8, "num_cpus": 0}


@dataclass(frozen=True)
class PauseSpan:
    """A refit to ``version`` held the engine from ``start`` (``on_refit_begin`` returned:
    the engine at a step boundary) to ``end`` (``on_refit_commit`` called), monotonic s."""

    version: int
    start: float
    end: float


@dataclass(frozen=True)
class EngineTimeline:
    """When an engine generated each token and when refits paused it (monotonic seconds,
    one clock for every process of a host)."""

    token_times: list[float]
    pauses: list[PauseSpan]


class TimedEngine(ReferenceEngine):
    """A reference engine that records the time of every token it generates and the span
    of every refit's pause."""

    def __init__(self, config: ReferenceModelConfig, seed: int) -> None:
        super().__init__(config, seed=seed)
        self._token_times: list[float] = []
        self._pauses: list[PauseSpan] = []
        self._paused_at: float | None = None

    def _advance(self, request: Any, version: int) -> None:
        super()._advance(request, version)
        self._token_times.append(time.monotonic())

    def on_refit_begin(self, version: int) -> None:
        super().on_refit_begin(version)  # returns once the step in progress has ended
        self._paused_at = time.monotonic()

    def on_refit_commit(self, version: int) -> None:
        if self._paused_at is not None:
            self._pauses.append(PauseSpan(version, self._paused_at, time.monotonic()))
            self._paused_at = None
        super().on_refit_commit(version)

    def timeline(self) -> EngineTimeline:
        """Copies of the token times and pause spans so far."""
        return EngineTimeline(list(self._token_times), list(self._pauses))


class InflightWorker(EngineEndpoint):
    """One engine process: a :class:`TimedEngine` behind refit-nccl's engine endpoint."""

    def __init__(
        self, config: ReferenceModelConfig, geometry: CollectiveSenderSpec, seed: int
    ) -> None:
        torch.set_num_threads(1)
        self._timed = TimedEngine(config, seed)
        super().__init__(lambda: self._timed, geometry)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, wait_s: float
    ) -> GenerationOutput:
        """The engine's whole output; a request that arrives during a pause waits ``wait_s``."""
        return self._timed.generate(prompts, max_new_tokens, wait_s=wait_s)

    def timeline(self) -> EngineTimeline:
        """The engine's token times and pauses so far."""
        return self._timed.timeline()

    def state_digests(self) -> dict[str, int]:
        """Bitwise digest of every live weight, under checkpoint names."""
        return self._timed.state_digests()

    def pid(self) -> int:
        """The worker's process id."""
        return os.getpid()


class InflightFleet(ActorFleet):
    """``engines`` :class:`InflightWorker` actors, one shard each (a ``CollectiveGeneration``);
    returns once every worker is up (within ``startup_s``)."""

    def __init__(
        self,
        config: ReferenceModelConfig,
        engines: int,
        *,
        seed: int,
        geometry: CollectiveSenderSpec,
        startup_s: float,
        timeout_s: float,
    ) -> None:
        remote = ray.remote(InflightWorker).options(**_ACTOR_OPTIONS)
        workers: list[Any] = [remote.remote(config, geometry, seed) for _ in range(engines)]
        super().__init__(workers, timeout_s=timeout_s)
        try:
            ray.get([worker.pid.remote() for worker in workers], timeout=startup_s)
        except BaseException:
            self.close()
            raise

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        """Shard index -> its worker."""
        return {index: [worker] for index, worker in enumerate(self.workers)}
