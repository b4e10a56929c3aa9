"""Your own engine on refit's collective row: refits, a killed worker, recovery.

The engine below is user code: a two-layer torch model served from Ray actors. It
implements what the collective row calls (``refit_nccl.CollectiveEngine``) and the optional
notifications of ``refit_core.RefitHooks``, so it never answers from weights that are being
written. ``main()`` refits it a few times, kills one worker in the middle of a refit, shows
the structured error, recovers, and refits the survivors again.

Run it: ``uv run python examples/custom_engine.py`` (about a minute on two CPU cores).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from torch import nn

from refit_core import (
    FleetStatus,
    RecoveryReport,
    RefitError,
    WeightSynchronizer,
    create_weight_synchronizer,
)
from refit_core.backend import CollectiveSenderSpec
from refit_core.sources import StateDictSource
from refit_lab.ray_cluster import LocalCluster, local_ray
from refit_nccl import EngineEndpoint

Weights = dict[str, torch.Tensor]
PROMPT = torch.ones(1, 256)


class TinyModel(nn.Module):
    """The model both sides share: the trainer trains it, the engines serve it."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(256, 1024)
        self.fc2 = nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = torch.relu(self.fc1(x))
        out: torch.Tensor = self.fc2(hidden)
        return out


class EngineClosedError(RuntimeError):
    """The engine's weights are being written or are partial: it answers nothing."""


# --8<-- [start:engine]
class TinyEngine:
    """The user's engine: ``CollectiveEngine`` (load, reset cache, commit a version, say
    what it accepts), ``RelayEngine`` (its version and live tensors, for the sparse row:
    ``examples/sparse_custom_engine.py``) plus the ``RefitHooks`` (closed from begin until
    commit, or until an abort that left the weights as they were).

    ``events`` records every hook and every answered request, so a test can check that no
    request was answered while the engine was closed.
    """

    def __init__(self, seed: int) -> None:
        self.model = TinyModel(seed).requires_grad_(False)
        self.version = 0
        self.closed = False
        self.events: list[tuple[str, int]] = []
        # Fault injection for the demos and their tests: the next time its weights start to
        # change (on_refit_begin, or a load into an engine a failed refit left closed) the
        # engine hangs for good ("hang") or freezes its whole process ("freeze").
        self.fault: str | None = None
        self.hanging = False
        self._step = threading.Lock()  # held while a request runs: the step boundary
        self._prefix_cache: dict[bytes, torch.Tensor] = {}

    # -- refit_nccl.CollectiveEngine ---------------------------------------------------

    def checkpoint_tensor_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {
            name: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in self.model.state_dict().items()
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._inject_fault()
        params = self.model.state_dict()
        for name, tensor in weights:  # only valid during this call: copy, do not keep
            params[name].copy_(tensor)

    def reset_prefix_cache(self) -> None:
        self._prefix_cache.clear()

    def set_weight_version(self, version: int) -> None:
        self.version = version

    # -- refit_zmq.sparse.RelayEngine (the rest is above) -----------------------------------

    @property
    def weight_version(self) -> int:
        return self.version

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())  # views of the live weights, written in place

    # -- refit_core.RefitHooks ---------------------------------------------------------

    def on_refit_begin(self, version: int) -> None:
        with self._step:  # waits for the request in flight, then holds every new one off
            self.closed = True
            self.events.append(("begin", version))
        self._inject_fault()

    def _inject_fault(self) -> None:
        fault, self.fault = self.fault, None
        if fault == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until SIGCONT
        elif fault == "hang":
            self.hanging = True
            threading.Event().wait()  # stuck for good: the framework kills the worker

    def on_refit_abort(self, version: int, *, weights_changed: bool) -> None:
        with self._step:
            self.closed = weights_changed  # partial weights: stay closed until a commit
            self.events.append(("abort-partial" if weights_changed else "abort", version))

    def on_refit_commit(self, version: int) -> None:
        with self._step:
            self.closed = False
            self.events.append(("commit", version))

    # -- serving -----------------------------------------------------------------------

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        with self._step:
            if self.closed:
                raise EngineClosedError(f"closed during a refit (serving version {self.version})")
            self.events.append(("generate", self.version))
            key = x.numpy().tobytes()
            if key not in self._prefix_cache:
                self._prefix_cache[key] = self.model(x)
            return self._prefix_cache[key]

    # --8<-- [end:engine]

    def weights(self) -> Weights:
        return {name: t.clone() for name, t in self.model.state_dict().items()}


GEOMETRY = CollectiveSenderSpec(
    "refit", buffer_size_bytes=1 << 20, num_buffers=2
)  # 2 MiB: 3 buckets


# --8<-- [start:worker]
class EngineWorker(EngineEndpoint):
    """One engine worker, a Ray actor: refit's endpoint around the user's engine, plus the
    user's own serving methods."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)
        self.tiny_engine = TinyEngine(seed)
        super().__init__(lambda: self.tiny_engine, GEOMETRY)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiny_engine.generate(x)

    def weights(self) -> Weights:
        return self.tiny_engine.weights()

    def events(self) -> list[tuple[str, int]]:
        return list(self.tiny_engine.events)

    def fault_in_next_write(self, fault: str) -> None:
        """Make the engine hang (``"hang"``) or freeze (``"freeze"``) the next time its
        weights start to change."""
        self.tiny_engine.fault = fault

    def is_hanging(self) -> bool:
        return self.tiny_engine.hanging

    def version(self) -> int:
        return self.tiny_engine.version

    def is_closed(self) -> bool:
        return self.tiny_engine.closed

    def pid(self) -> int:
        return os.getpid()


# --8<-- [end:worker]


class EngineFleet:
    """The generation: engine shards of one worker each (``collective_shards()``)."""

    def __init__(self, shards: int) -> None:
        actor = ray.remote(EngineWorker).options(max_concurrency=4, num_cpus=0)
        self.workers: dict[int, Any] = {i: actor.remote(seed=100 + i) for i in range(shards)}

    def collective_shards(self) -> Mapping[int, Sequence[Any]]:
        return {index: [worker] for index, worker in self.workers.items()}

    def close(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker, no_restart=True)


class Trainer:
    """The policy: a model trained in this process; refit reads ``weight_source()``."""

    def __init__(self, seed: int = 0) -> None:
        self.model = TinyModel(seed)
        self._optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.model)

    def step(self) -> None:
        loss = (self.model(torch.randn(8, 256)) - 1.0).pow(2).mean()
        self._optimizer.zero_grad()
        loss.backward()
        self._optimizer.step()

    def weights(self) -> Weights:
        return {name: t.detach().clone() for name, t in self.model.state_dict().items()}


# --8<-- [start:synchronizer]
def make_synchronizer(trainer: Trainer, fleet: EngineFleet) -> WeightSynchronizer:
    return create_weight_synchronizer(
        trainer,
        fleet,
        "vllm",  # the collective row speaks EngineEndpoint, whatever runs behind it
        colocated=False,
        train_cluster=LocalCluster(1),  # get_master_address_and_port(): the rendezvous
        inference_cluster=LocalCluster(len(fleet.workers)),
        refit_timeout_s=30.0,
    )


# --8<-- [end:synchronizer]


@dataclass
class Traffic:
    """Requests sent to every engine in a loop while the refits run."""

    workers: dict[int, Any]
    answered: int = 0
    refused: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)

    def _run(self) -> None:
        targets = dict(self.workers)
        while targets and not self._stop.wait(0.01):
            for shard, worker in list(targets.items()):
                try:
                    ray.get(worker.generate.remote(PROMPT), timeout=60)
                    self.answered += 1
                except ray.exceptions.RayTaskError:  # EngineClosedError
                    self.refused += 1
                except ray.exceptions.RayActorError:  # killed: stop asking it
                    del targets[shard]


@dataclass
class Refit:
    """One committed refit, with the trainer's weights and every live engine's."""

    version: int
    trainer: Weights
    engines: dict[int, Weights]


@dataclass
class Outcome:
    """Everything ``run`` saw, for the printout and for the test."""

    refits: list[Refit]
    killed_shard: int
    error: RefitError
    released_after_s: float
    refused_while_closed: bool
    status: FleetStatus
    recovery: RecoveryReport
    traffic: Traffic
    events: dict[int, list[tuple[str, int]]]


def read_back(version: int, trainer: Trainer, workers: Mapping[int, Any], live: list[int]) -> Refit:
    """The trainer's weights and those of every live engine (``workers``: shard -> actor), at
    ``version``."""
    weights = ray.get([workers[s].weights.remote() for s in live], timeout=60)
    return Refit(version, trainer.weights(), dict(zip(live, weights, strict=True)))


def refit(sync: WeightSynchronizer, trainer: Trainer, fleet: EngineFleet, live: list[int]) -> Refit:
    """One training step, one refit, and every live engine's weights read back."""
    trainer.step()
    return read_back(sync.sync_weights().version, trainer, fleet.workers, live)


def wait_for(what: str, condition: Any, within_s: float = 120.0) -> None:
    give_up = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > give_up:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)


def run(shards: int = 3, steps: int = 3, victim: int = 1) -> Outcome:
    """Refit ``steps`` times, kill shard ``victim`` in the middle of a refit, recover,
    refit once more. Needs a running Ray cluster."""
    fleet, trainer = EngineFleet(shards), Trainer()
    sync = make_synchronizer(trainer, fleet)
    traffic = Traffic(fleet.workers)
    everyone = list(fleet.workers)
    survivors = [s for s in everyone if s != victim]
    try:
        traffic.start()
        refits = [refit(sync, trainer, fleet, everyone) for _ in range(steps)]

        # The victim hangs as its weights start to change; the others load what they
        # received, so they are closed (their weights are partial); then the framework
        # kills the victim.
        ray.get(fleet.workers[victim].fault_in_next_write.remote("hang"), timeout=60)
        failure: dict[str, Any] = {}

        def failing_refit() -> None:
            try:
                refit(sync, trainer, fleet, everyone)
            except RefitError as error:
                failure["error"], failure["at"] = error, time.monotonic()

        thread = threading.Thread(target=failing_refit)
        thread.start()
        wait_for("the victim to hang", lambda: ray.get(fleet.workers[victim].is_hanging.remote()))
        wait_for(
            "the survivors to close",
            lambda: all(
                status.closed
                for status in ray.get([fleet.workers[s].refit_status.remote() for s in survivors])
            ),
        )
        killed_at = time.monotonic()
        ray.kill(fleet.workers[victim], no_restart=True)
        thread.join(60 + (sync.refit_timeout_s or 0))
        if "error" not in failure:
            raise RuntimeError("the refit went through although a worker was killed")
        error: RefitError = failure["error"]
        try:
            ray.get(fleet.workers[survivors[0]].generate.remote(PROMPT), timeout=60)
            refused = False
        except ray.exceptions.RayTaskError:
            refused = True

        # The recovery loop of a framework.
        status = sync.status()
        recovery = sync.recover()  # drops the dead shard, resyncs the closed survivors
        refits.append(read_back(sync.version, trainer, fleet.workers, survivors))
        refits.append(refit(sync, trainer, fleet, survivors))
        traffic.stop()
        events = dict(
            zip(
                survivors,
                ray.get([fleet.workers[s].events.remote() for s in survivors]),
                strict=True,
            )
        )
        return Outcome(
            refits,
            victim,
            error,
            failure["at"] - killed_at,
            refused,
            status,
            recovery,
            traffic,
            events,
        )
    finally:
        traffic.stop()
        sync.shutdown()
        fleet.close()


def print_refits(refits: Sequence[Refit]) -> None:
    """One line per refit: its version, the shards that hold it, whether each is bit-exact."""
    for done in refits:
        exact = all(
            all(torch.equal(w[n], t) for n, t in done.trainer.items())
            for w in done.engines.values()
        )
        print(f"version {done.version} on shards {sorted(done.engines)}: bit-exact {exact}")


def print_error(error: RefitError) -> None:
    """A refit's error as a framework reads it: its type and message, its hint, its shards."""
    print(f"  {type(error).__name__}: {str(error)[:160]}")
    print(f"  recovery={error.recovery.value} failed_shards={error.failed_shards}")


def main() -> None:
    # refit logs each failure as one WARNING line; the demo prints the error's facts instead.
    logging.basicConfig(level=logging.ERROR)
    with local_ray(num_cpus=4, log_to_driver=False):
        outcome = run()
    print_refits(outcome.refits)
    error = outcome.error
    print(
        f"killed shard {outcome.killed_shard}; the refit failed {outcome.released_after_s:.2f} s later:"
    )
    print_error(error)
    for engine in error.engines:
        print(f"  shard {engine.shard} ({engine.worker}): {engine.state.value}")
    print(f"  a survivor refused a request while closed: {outcome.refused_while_closed}")
    print(f"status():  {outcome.status.describe()}")
    report = outcome.recovery
    resync = report.resync.version if report.resync else None
    print(
        f"recover(): dropped {report.dropped_shards}, resync to {resync}; {report.after.describe()}"
    )
    print(f"traffic: {outcome.traffic.answered} answered, {outcome.traffic.refused} refused")


if __name__ == "__main__":
    main()
