"""The fleets and controllers of the driver-loop tests (shipped to Ray workers by value).

Both rows run ``examples/custom_engine.py``'s ``TinyEngine`` in Ray actors, three shards:
the collective row through ``EngineEndpoint`` workers, the sparse row through ``EngineRelay``
workers (``examples/sparse_custom_engine.py``). A fleet can replace a worker (a restart), and
tell which workers run, which are frozen, and what each engine holds. A controller can also
run in a process of its own (:func:`crashing_controller`), which a test kills mid-refit.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray
import torch

from custom_engine import EngineWorker, Trainer
from refit_core import NamedTensor, WeightSynchronizer, create_weight_synchronizer
from refit_core.sources import StateDictSource
from refit_lab.ray_cluster import LocalCluster
from refit_zmq.sparse import ZmqSparseOptions
from sparse_custom_engine import TUNING, RelayWorker

ROWS = ("collective", "zmq_sparse")


def digest(weights: Mapping[str, torch.Tensor]) -> str:
    """One digest of a whole set of weights, bit for bit."""
    hashed = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        hashed.update(name.encode())
        hashed.update(weights[name].contiguous().view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


class SlowSource:
    """A weight source that yields each tensor ``delay_s`` late (a transfer that needs longer
    than a short deadline, with every participant alive)."""

    def __init__(self, source: StateDictSource, delay_s: float) -> None:
        self._source = source
        self._delay_s = delay_s

    def state_dict_info(self) -> Any:
        return self._source.state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        for named in self._source.iter_tensors():
            time.sleep(self._delay_s)
            yield named


class TestTrainer(Trainer):
    """The example's trainer, whose source can be slowed down and whose state can be copied."""

    __test__ = False

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.delay_s = 0.0

    def weight_source(self) -> Any:
        source = super().weight_source()
        return SlowSource(source, self.delay_s) if self.delay_s else source

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights))


class Fleet:
    """Three engine workers of one row, as the generation a synchronizer takes.

    ``generation`` counts the restarts; collective workers are named actors (a controller in
    another process finds them by name)."""

    def __init__(self, row: str, shards: int = 3) -> None:
        self.row = row
        self.workers: dict[int, Any] = {}
        self.names: dict[int, str] = {}
        self.addresses: dict[int, str] = {}
        self.frozen: set[int] = set()
        self.dead: set[int] = set()
        self._starts = 0
        for shard in range(shards):
            self.restart(shard)

    def restart(self, shard: int) -> None:
        """A fresh worker for ``shard`` (a new process; its engine holds its seed's weights at
        version 0)."""
        self._starts += 1
        name = f"{self.row}-{shard}-{self._starts}"
        cls = EngineWorker if self.row == "collective" else RelayWorker
        actor = ray.remote(cls).options(max_concurrency=4, num_cpus=0, name=name)
        worker = actor.remote(seed=100 + shard)
        ray.get(worker.pid.remote(), timeout=120)
        self.workers[shard], self.names[shard] = worker, name
        if self.row == "zmq_sparse":
            self.addresses[shard] = ray.get(worker.relay_address.remote(), timeout=60)
        self.frozen.discard(shard)
        self.dead.discard(shard)

    # -- the generation ---------------------------------------------------------------

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        return {shard: [worker] for shard, worker in self.workers.items()}

    def relay_addresses(self) -> Sequence[str]:
        return [self.addresses[shard] for shard in sorted(self.workers)]

    # -- faults -----------------------------------------------------------------------

    def pid(self, shard: int) -> int:
        pid: int = ray.get(self.workers[shard].pid.remote(), timeout=60)
        return pid

    def freeze(self, shard: int) -> None:
        """Freeze ``shard`` the next time its weights start to change (inside its refit hook,
        or inside a load into an engine a failed refit left closed)."""
        ray.get(self.workers[shard].fault_in_next_write.remote("freeze"), timeout=60)
        self.frozen.add(shard)

    def thaw(self, shard: int, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        self.frozen.discard(shard)

    def kill(self, shard: int) -> None:
        ray.kill(self.workers[shard], no_restart=True)
        self.dead.add(shard)

    def close(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker, no_restart=True)

    # -- what the engines hold --------------------------------------------------------

    def running(self) -> list[int]:
        """The shards whose worker runs (neither dead nor frozen)."""
        return [s for s in sorted(self.workers) if s not in self.frozen | self.dead]

    def held(self, shards: Sequence[int]) -> dict[int, tuple[int, bool, str]]:
        """Shard -> (the version its engine reports, whether it is closed, its digest)."""
        calls = [
            (w.version.remote(), w.is_closed.remote(), w.weights.remote())
            for w in (self.workers[s] for s in shards)
        ]
        answers = ray.get([call for triple in calls for call in triple], timeout=120)
        return {
            shard: (answers[3 * i], answers[3 * i + 1], digest(answers[3 * i + 2]))
            for i, shard in enumerate(shards)
        }

    def began(self, shard: int) -> list[int]:
        """The versions ``shard``'s engine was told began, in order."""
        events = ray.get(self.workers[shard].events.remote(), timeout=60)
        return [version for hook, version in events if hook == "begin"]

    def committed(self, shard: int) -> list[int]:
        """The versions ``shard``'s engine was told committed, in order."""
        events = ray.get(self.workers[shard].events.remote(), timeout=60)
        return [version for hook, version in events if hook == "commit"]


class NamedWorkers:
    """The collective generation of a controller in another process: the workers by name."""

    def __init__(self, names: Mapping[int, str]) -> None:
        self._workers = {shard: ray.get_actor(name) for shard, name in names.items()}

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        return {shard: [worker] for shard, worker in self._workers.items()}


class Relays:
    """The sparse generation of a controller in another process: the relays' addresses."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = list(addresses)

    def relay_addresses(self) -> Sequence[str]:
        return list(self._addresses)


def synchronizer(
    row: str, trainer: Trainer, generation: Any, deadline_s: float
) -> WeightSynchronizer:
    """A controller's synchronizer over ``generation`` (what a framework builds at start)."""
    if row == "collective":
        return create_weight_synchronizer(
            trainer,
            generation,
            "vllm",
            colocated=False,
            train_cluster=LocalCluster(1),
            refit_timeout_s=deadline_s,
        )
    return create_weight_synchronizer(
        trainer,
        generation,
        "vllm",
        colocated=False,
        refit_timeout_s=deadline_s,
        transport="zmq_sparse",
        options=ZmqSparseOptions(bucket_size_bytes=1 << 20, tuning=TUNING),
    )


def crashing_controller(
    row: str,
    address: str,
    namespace: str,
    generation: Mapping[int, str],
    weights: Mapping[str, torch.Tensor],
    deadline_s: float,
) -> None:
    """A controller in a process of its own: it refits ``weights`` (slowly, so that a test can
    kill it in the middle: the trainer's source waits before each tensor) and is killed."""
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    torch.set_num_threads(1)
    trainer = TestTrainer()
    trainer.load(weights)
    trainer.delay_s = 0.5
    fleet: Any = (
        NamedWorkers(generation) if row == "collective" else Relays(list(generation.values()))
    )
    sync = synchronizer(row, trainer, fleet, deadline_s)
    sync.sync_weights()  # the test kills this process before it ends
