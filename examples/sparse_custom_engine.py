"""Your own engine on refit's sparse row: deltas over the relay tree, a frozen worker, recovery.

The engine is ``examples/custom_engine.py``'s ``TinyEngine`` (user code: a two-layer torch
model served from Ray actors), which also implements what the sparse row calls
(``refit_zmq.sparse.RelayEngine``: its version and its live tensors). Each worker runs a relay
beside its engine (``EngineRelay(engine)``); the relay writes every delta in place, with undo,
and tells the engine through its ``RefitHooks``. ``main()`` refits a few times, freezes one
worker (SIGSTOP) inside its ``on_refit_begin`` past the deadline, shows the error,
``recover()`` leaving it out, thaws it while the others refit (it rolls the transfer back on
its own and serves its old version again, told by ``on_refit_abort``), sees it answer again
(``status().returned``) and lets ``recover()`` take it back in.

Run it: ``uv run python examples/sparse_custom_engine.py`` (about a minute on two CPU cores).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from custom_engine import (
    Refit,
    TinyEngine,
    Trainer,
    Weights,
    print_error,
    print_refits,
    read_back,
    wait_for,
)
from refit_core import (
    FleetStatus,
    RecoveryReport,
    RefitError,
    WeightSynchronizer,
    create_weight_synchronizer,
)
from refit_lab.ray_cluster import local_ray
from refit_zmq.relay import RelayTuning
from refit_zmq.sparse import EngineRelay, ZmqSparseOptions

DEADLINE_S = 5.0
# Small chunks (the protocol's least): a payload arrives in hundreds of them, so a worker that
# freezes in its on_refit_begin does so while most of its first payload is still on the wire.
TUNING = RelayTuning(chunk_bytes=4096, max_inflight_bytes=16 << 20, retries=1)


class RelayWorker:
    """One engine worker, a Ray actor: the user's engine and refit's relay beside it, plus the
    user's own methods."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)
        self.tiny_engine = TinyEngine(seed)
        self.relay = EngineRelay(self.tiny_engine, timeout_s=DEADLINE_S, tuning=TUNING)
        self.address = self.relay.start()

    def relay_address(self) -> str:
        return self.address

    def weights(self) -> Weights:
        return self.tiny_engine.weights()

    def version(self) -> int:
        return self.tiny_engine.version

    def is_closed(self) -> bool:
        return self.tiny_engine.closed

    def events(self) -> list[tuple[str, int]]:
        return [e for e in self.tiny_engine.events if e[0] != "generate"]

    def fault_in_next_write(self, fault: str) -> None:
        """Make the engine hang (``"hang"``) or freeze (``"freeze"``) in its next
        ``on_refit_begin`` (the relay calls it before the first byte of each transfer)."""
        self.tiny_engine.fault = fault

    def is_hanging(self) -> bool:
        return self.tiny_engine.hanging

    def pid(self) -> int:
        return os.getpid()


class RelayFleet:
    """The generation: one relay per engine shard, in shard order (``relay_addresses()``).

    The addresses are asked once, when the workers start: a frozen worker could not answer,
    and ``relay_addresses()`` is called on every status and recovery."""

    def __init__(self, shards: int) -> None:
        actor = ray.remote(RelayWorker).options(max_concurrency=2, num_cpus=0)
        self.workers: dict[int, Any] = {i: actor.remote(seed=100 + i) for i in range(shards)}
        self._addresses = ray.get([w.relay_address.remote() for w in self.workers.values()])

    def relay_addresses(self) -> Sequence[str]:
        return list(self._addresses)

    def close(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker, no_restart=True)


def make_synchronizer(trainer: Trainer, fleet: RelayFleet) -> WeightSynchronizer:
    return create_weight_synchronizer(
        trainer,  # weight_source(): its deltas are encoded in this process
        fleet,  # relay_addresses()
        "vllm",  # the sparse row speaks EngineRelay, whatever runs behind it
        colocated=False,
        refit_timeout_s=DEADLINE_S,
        transport="zmq_sparse",
        options=ZmqSparseOptions(bucket_size_bytes=1 << 20, tuning=TUNING),
    )


@dataclass
class Outcome:
    """Everything ``run`` saw, for the printout and for the test."""

    refits: list[Refit]
    frozen_shard: int
    error: RefitError
    status: FleetStatus
    status_s: float
    recovery: RecoveryReport
    recovery_s: float
    thawed_version: int
    thawed_closed: bool
    thawed_weights: Weights
    returned: FleetStatus
    rejoined: RecoveryReport
    events: dict[int, list[tuple[str, int]]]


def refit(sync: WeightSynchronizer, trainer: Trainer, fleet: RelayFleet, live: list[int]) -> Refit:
    """One training step, one refit, and every live engine's weights read back."""
    trainer.step()
    return read_back(sync.sync_weights().version, trainer, fleet.workers, live)


def timed(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    return call(), time.monotonic() - started


def run(shards: int = 3, steps: int = 3, victim: int = 1) -> Outcome:
    """Refit ``steps`` times, freeze shard ``victim`` inside its next ``on_refit_begin``, let
    the refit fail, recover without it, thaw it while the others refit, and take it back in.
    Needs a running Ray cluster."""
    fleet, trainer = RelayFleet(shards), Trainer()
    sync = make_synchronizer(trainer, fleet)
    everyone = list(fleet.workers)
    survivors = [s for s in everyone if s != victim]
    worker = fleet.workers[victim]
    pid = ray.get(worker.pid.remote(), timeout=60)
    try:
        refits = [refit(sync, trainer, fleet, everyone) for _ in range(steps)]
        before = refits[-1]

        ray.get(worker.fault_in_next_write.remote("freeze"), timeout=60)
        try:
            refit(sync, trainer, fleet, everyone)
            raise RuntimeError("the refit went through although a worker was frozen")
        except RefitError as failed:
            error = failed
        status, status_s = timed(sync.status)
        recovery, recovery_s = timed(sync.recover)

        # The others refit again; the frozen worker is thawed in the middle of that refit.
        thaw = threading.Timer(0.2, os.kill, (pid, signal.SIGCONT))
        thaw.start()
        refits.append(refit(sync, trainer, fleet, survivors))
        thaw.join()
        wait_for("the thawed worker to roll back", lambda: not ray.get(worker.is_closed.remote()))
        thawed_version = ray.get(worker.version.remote(), timeout=60)
        thawed_closed = ray.get(worker.is_closed.remote(), timeout=60)
        thawed_weights = ray.get(worker.weights.remote(), timeout=60)
        if thawed_version != before.version:
            raise RuntimeError(f"the thawed worker serves {thawed_version}")

        returned = sync.status()  # the left-out shard answers again
        rejoined = sync.recover()  # takes it back in, with a dense resync
        refits.append(read_back(sync.version, trainer, fleet.workers, everyone))
        refits.append(refit(sync, trainer, fleet, everyone))
        calls = [fleet.workers[s].events.remote() for s in everyone]
        events = dict(zip(everyone, ray.get(calls, timeout=60), strict=True))
        return Outcome(
            refits,
            victim,
            error,
            status,
            status_s,
            recovery,
            recovery_s,
            thawed_version,
            thawed_closed,
            thawed_weights,
            returned,
            rejoined,
            events,
        )
    finally:
        os.kill(pid, signal.SIGCONT)
        sync.shutdown()
        fleet.close()


def main() -> None:
    # refit logs every failure at WARNING with its traceback; the demo prints the error's facts.
    logging.basicConfig(level=logging.ERROR)
    with local_ray(num_cpus=4, log_to_driver=False):
        outcome = run()
    print_refits(outcome.refits)
    error = outcome.error
    print(f"froze shard {outcome.frozen_shard} inside on_refit_begin; the refit failed:")
    print_error(error)
    print(f"status() in {outcome.status_s:.2f} s:  {outcome.status.describe()}")
    report = outcome.recovery
    print(f"recover() in {outcome.recovery_s:.2f} s: dropped {report.dropped_shards}")
    print(
        f"thawed: serves version {outcome.thawed_version}, closed {outcome.thawed_closed}; "
        f"status(): {outcome.returned.describe()}, returned {outcome.returned.returned}"
    )
    resync = outcome.rejoined.resync
    print(
        f"recover(): resync to {resync.version if resync else None}; "
        f"{outcome.rejoined.after.describe()}"
    )
    print(f"hooks of shard {outcome.frozen_shard}: {outcome.events[outcome.frozen_shard]}")


if __name__ == "__main__":
    main()
