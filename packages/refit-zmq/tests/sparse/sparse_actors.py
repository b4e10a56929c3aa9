"""Reference-engine workers as Ray actors, each with a relay beside it (shipped by value)."""

from __future__ import annotations

import os
from typing import Any

import ray

from refit_lab.conformance import EngineWorkerProbes
from refit_lab.ray_cluster import ActorFleet
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_zmq.relay import RelayTuning, ShardProducer
from refit_zmq.sparse import EngineRelay

CONFIG = ReferenceModelConfig(vocab_size=256, hidden_size=64, num_layers=2, intermediate_size=128)
TUNING = RelayTuning(chunk_bytes=64 * 1024, max_inflight_bytes=16 << 20, retries=1)


class EngineWorker(EngineWorkerProbes):
    """One engine worker with its relay; ``reset`` starts a fresh engine and relay in place
    (a new process per test would cost seconds of torch imports)."""

    def __init__(self, config: ReferenceModelConfig, seed: int) -> None:
        self._config = config
        self._start(seed)

    def _start(self, seed: int) -> None:
        torch_threads = 1
        import torch

        torch.set_num_threads(torch_threads)
        self.engine = ReferenceEngine(self._config, seed=seed)
        self.relay = EngineRelay(self.engine, timeout_s=5.0, tuning=TUNING)
        self.address = self.relay.start()

    def reset(self, seed: int) -> None:
        self.relay.close()
        self._start(seed)

    def stop_relay(self) -> None:
        self.relay.close()

    def relay_address(self) -> str:
        return self.address


RemoteEngineWorker = ray.remote(EngineWorker)


class EngineFleet(ActorFleet):
    """Engine workers as a ``ZmqRelayGeneration``."""

    def __init__(self, config: ReferenceModelConfig, workers: int) -> None:
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": 0}
        super().__init__(
            [RemoteEngineWorker.options(**options).remote(config, 100 + i) for i in range(workers)]
        )

    def relay_addresses(self) -> list[str]:
        addresses: list[str] = self.call("relay_address")
        return addresses


class TrainerRank(ShardProducer):
    """A data-parallel trainer rank: a replica of the trainer, producing its shard."""

    def __init__(self, checkpoint_seed: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.trainer = SimulatedTrainer(random_checkpoint(CONFIG, checkpoint_seed))
        super().__init__(self.trainer)

    def step(self) -> None:
        self.trainer.step()

    def pid(self) -> int:
        return os.getpid()


RemoteTrainerRank = ray.remote(TrainerRank)


class RayTrainer:
    """A trainer whose ranks are Ray actors (a ``ZmqProducerPolicy``)."""

    def __init__(self, ranks: int, checkpoint_seed: int) -> None:
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": 0}
        self.ranks = [
            RemoteTrainerRank.options(**options).remote(checkpoint_seed) for _ in range(ranks)
        ]
        ray.get([rank.pid.remote() for rank in self.ranks], timeout=120)  # started

    def zmq_producers(self) -> list[Any]:
        return list(self.ranks)

    def step(self) -> None:
        ray.get([rank.step.remote() for rank in self.ranks], timeout=120)

    def close(self) -> None:
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
