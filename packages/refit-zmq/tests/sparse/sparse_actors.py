"""Reference-engine workers as Ray actors, each with a relay beside it (shipped by value)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray

from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_zmq.relay import RelayTuning
from refit_zmq.sparse import EngineRelay

CONFIG = ReferenceModelConfig(vocab_size=256, hidden_size=64, num_layers=2, intermediate_size=128)
TUNING = RelayTuning(chunk_bytes=64 * 1024, max_inflight_bytes=16 << 20, retries=1)


class EngineWorker:
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

    def state_digests(self) -> dict[str, int]:
        return self.engine.state_digests()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens).tokens

    def weight_version(self) -> int:
        return self.engine.weight_version

    def pid(self) -> int:
        return os.getpid()


RemoteEngineWorker = ray.remote(EngineWorker)


class EngineFleet:
    """Engine workers as a ``ZmqRelayGeneration``."""

    def __init__(self, config: ReferenceModelConfig, workers: int) -> None:
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": 0}
        self.workers = [
            RemoteEngineWorker.options(**options).remote(config, 100 + i) for i in range(workers)
        ]

    def relay_addresses(self) -> list[str]:
        addresses: list[str] = self.call("relay_address")
        return addresses

    def call(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(w, method).remote(*args) for w in self.workers], timeout=120)

    def reset(self, seed: int) -> None:
        ray.get([w.reset.remote(seed + i) for i, w in enumerate(self.workers)], timeout=120)

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
