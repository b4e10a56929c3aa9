"""The demo's inference workers: reference engines in Ray actors, and the fleet around them.

Every worker serves refit-nccl's collective endpoint (it *is* an ``EngineEndpoint``) and can
run a refit-zmq relay or IPC receiver beside its engine, so one worker class serves every
transport.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from refit_lab.reference_engine import GenerationOutput, ReferenceEngine, ReferenceModelConfig
from refit_nccl import EngineEndpoint
from refit_zmq.ipc import IpcReceiver
from refit_zmq.sparse import EngineRelay

__all__ = ["DemoFleet", "DemoWorker"]

logger = logging.getLogger(__name__)

_ACTOR_OPTIONS: dict[str, Any] = {"max_concurrency": 8, "num_cpus": 0}
_CALL_TIMEOUT_S = 120.0


class DemoWorker(EngineEndpoint):
    """One inference worker: a reference engine on the trainer's initial checkpoint."""

    def __init__(self, config: ReferenceModelConfig, checkpoint_seed: int) -> None:
        torch.set_num_threads(1)
        self._reference = ReferenceEngine(config, seed=checkpoint_seed)
        super().__init__(lambda: self._reference)
        self._relay: EngineRelay | None = None
        self._ipc: IpcReceiver | None = None

    def start_relay(self, timeout_s: float) -> str:
        """Start (or restart) the relay beside the engine; its address."""
        self.stop_relay()
        self._relay = EngineRelay(self._reference, timeout_s=timeout_s)
        return self._relay.start()

    def stop_relay(self) -> None:
        """Stop the relay, if one runs (the engine keeps serving)."""
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def start_ipc_receiver(self) -> str:
        """Serve the colocated IPC channel beside the engine; the control address."""
        if self._ipc is None:
            self._ipc = IpcReceiver(self._reference, version=self._reference.weight_version)
            self._ipc.start()
        return self._ipc.address

    def state_digests(self) -> dict[str, int]:
        """Bitwise digest of every live weight, under checkpoint names."""
        return self._reference.state_digests()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of ``prompts``."""
        return self._reference.generate(prompts, max_new_tokens).tokens

    def serve(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, wait_s: float
    ) -> GenerationOutput:
        """One request as a client sends it (``--inflight``): the whole output, its version
        spans included; a request that arrives during a pause waits up to ``wait_s``."""
        return self._reference.generate(prompts, max_new_tokens, wait_s=wait_s)

    def served_version(self) -> int:
        """The weight version the engine serves."""
        return self._reference.weight_version

    def pid(self) -> int:
        """The worker's process id."""
        return os.getpid()


class DemoFleet:
    """``workers`` demo workers: a ``ZmqRelayGeneration``, ``CollectiveGeneration`` and
    ``IpcGeneration``.

    Worker ``i`` is shard ``i`` for ``reconcile_communicator``; a dead worker keeps its
    index (and its last relay address), so shard numbers never shift.
    """

    exposes_bits = True
    """Reference engines hold checkpoint-format weights: ``state_digests`` is bitwise."""

    def __init__(self, config: ReferenceModelConfig, workers: int, checkpoint_seed: int) -> None:
        remote = ray.remote(DemoWorker).options(**_ACTOR_OPTIONS)
        self.workers: dict[int, Any] = {
            index: remote.remote(config, checkpoint_seed) for index in range(workers)
        }
        self.dead: set[int] = set()
        self._relays: dict[int, str] = {}
        self._relay_overrides: dict[int, str] = {}
        self._ipc: dict[int, str] = {}
        self.pids: dict[int, int] = self.call("pid")

    @property
    def live(self) -> list[int]:
        """Indices of the workers still alive, in order."""
        return [index for index in self.workers if index not in self.dead]

    def start_relays(self, timeout_s: float) -> None:
        """Start a relay beside every live worker."""
        for index, address in zip(self.live, self._call_all("start_relay", timeout_s), strict=True):
            self._relays[index] = address

    def restart_relay(self, index: int, timeout_s: float) -> None:
        """Start a fresh relay on worker ``index`` (on a new port)."""
        self._relays[index] = ray.get(
            self.workers[index].start_relay.remote(timeout_s), timeout=_CALL_TIMEOUT_S
        )

    def route_relay(self, index: int, address: str) -> None:
        """Publish ``address`` (a proxy in front of it) as worker ``index``'s relay."""
        self._relay_overrides[index] = address

    def relay_address(self, index: int) -> str:
        """Worker ``index``'s own relay address (never a proxy's)."""
        return self._relays[index]

    def relay_addresses(self) -> list[str]:
        """Every worker's relay address, in shard order (``ZmqRelayGeneration``)."""
        return [self._relay_overrides.get(i, self._relays[i]) for i in sorted(self._relays)]

    def start_ipc_receivers(self) -> None:
        """Start an IPC receiver beside every live worker."""
        self._ipc = self.call("start_ipc_receiver")

    def ipc_addresses(self) -> list[str]:
        """Every worker's IPC control address, in shard order (``IpcGeneration``)."""
        return [self._ipc[i] for i in sorted(self._ipc)]

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        """Shard index -> its worker (``CollectiveGeneration``)."""
        return {index: [handle] for index, handle in self.workers.items()}

    def mark_dead(self, index: int) -> None:
        """Leave worker ``index`` out of every later call."""
        self.dead.add(index)

    def call(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` on every live worker; index -> result."""
        return dict(zip(self.live, self._call_all(method, *args), strict=True))

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on worker ``index``."""
        return ray.get(getattr(self.workers[index], method).remote(*args), timeout=_CALL_TIMEOUT_S)

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        refs = [getattr(self.workers[i], method).remote(*args) for i in self.live]
        return list(ray.get(refs, timeout=_CALL_TIMEOUT_S))

    def close(self) -> None:
        """Kill every worker actor."""
        for handle in self.workers.values():
            ray.kill(handle, no_restart=True)
