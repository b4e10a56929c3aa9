"""Reference-engine workers as Ray actors, each serving an IpcReceiver (shipped by value)."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any

import ray
import torch

from refit_lab.conformance import EngineWorkerProbes
from refit_lab.faults import fault_self
from refit_lab.ray_cluster import ActorFleet
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_zmq.ipc import IpcReceiver

CONFIG = ReferenceModelConfig(vocab_size=256, hidden_size=64, num_layers=2, intermediate_size=128)
"""Embedding and lm_head are 32 KiB each; every other tensor is at most 16 KiB."""


class FaultyEngine(ReferenceEngine):
    """A reference engine that sends itself ``fault`` (SIGKILL, SIGSTOP) on load call ``at``."""

    def __init__(self, config: ReferenceModelConfig, seed: int, at: int, fault: int) -> None:
        self._calls = -1  # the initial load of the seed's checkpoint does not count
        self._at = at
        self._fault = signal.Signals(fault)
        super().__init__(config, seed=seed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._calls += 1
        if self._calls == self._at:
            fault_self(self._fault)
        return super().load_weights(weights)


class EngineWorker(EngineWorkerProbes):
    """One engine worker with its receiver; ``reset`` starts a fresh engine and receiver in
    place (a new process per test would cost seconds of torch imports)."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)
        self._start(seed, None)

    def _start(self, seed: int, fault: tuple[int, int] | None) -> None:
        if fault is None:
            self.engine = ReferenceEngine(CONFIG, seed=seed)
        else:
            self.engine = FaultyEngine(CONFIG, seed, *fault)
        self.receiver = IpcReceiver(self.engine)
        self.receiver.start()

    def reset(self, seed: int, fault: tuple[int, int] | None = None) -> None:
        self.receiver.close()
        self._start(seed, fault)

    def address(self) -> str:
        return self.receiver.address

    def partial(self) -> bool:
        return self.receiver.partial


RemoteEngineWorker = ray.remote(EngineWorker)


class EngineFleet(ActorFleet):
    """Engine workers (actors, one process each) as an ``IpcGeneration``."""

    def __init__(self, workers: int) -> None:
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": 0}
        super().__init__(
            [RemoteEngineWorker.options(**options).remote(100 + i) for i in range(workers)]
        )

    def ipc_addresses(self) -> list[str]:
        addresses: list[str] = self.call("address")
        return addresses
