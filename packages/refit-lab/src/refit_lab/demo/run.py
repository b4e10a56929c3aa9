"""Run the demo: train, refit the fleet after every step, verify, and inject one fault.

Each refit goes through ``create_weight_synchronizer`` exactly as a framework would call it;
the demo then checks every live worker against the trainer (bitwise digests where the
workers expose them, served version, greedy tokens from the trainer's own forward pass).
The workers are reference engines in Ray actors or behind Dynamo workers' system servers (one
process each), or real vLLM engines in this process. With ``inflight``, clients keep every
reference engine generating through the whole run, each refit is staged while they do and
committed in one pause (recorded beside the refit time), and no request may be lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from refit_core import RefitError, WeightSynchronizer, create_weight_synchronizer
from refit_lab.demo.report import DemoReport, RefitRecord
from refit_lab.demo.settings import DemoSettings
from refit_lab.demo.training import DemoTrainer, TrainingConfig
from refit_lab.digest import state_digest
from refit_lab.faults import kill
from refit_lab.ray_cluster import LocalCluster, local_ray
from refit_lab.serving_load import ServingCounts, ServingLoad
from refit_lab.zmq_faults import CorruptingRelayProxy

if TYPE_CHECKING:
    from refit_lab.demo.vllm_fleet import VllmFleet
    from refit_lab.demo.workers import DemoFleet

__all__ = ["STAGES", "Progress", "ProgressFactory", "run_demo"]

logger = logging.getLogger(__name__)

STAGES = ("train", "refit", "verify bits", "verify tokens")
"""What a step's progress bar advances through."""

_MiB = 1 << 20
_RELEASE_SLACK_S = 1.0
_CONTROL_SLACK_S = 10.0


class Progress(Protocol):
    """A progress bar of one step."""

    def advance(self, stage: str) -> None:
        """``stage`` is done."""
        ...

    def close(self) -> None:
        """The step is over."""
        ...


ProgressFactory = Callable[[str, int], Progress]
"""``(description, total stages) -> Progress``."""


class Fleet(Protocol):
    """The workers, as the demo verifies them (``DemoFleet`` or ``VllmFleet``)."""

    exposes_bits: bool
    """Whether ``state_digests`` reports checkpoint-format digests of what is served."""

    @property
    def live(self) -> list[int]:
        """Indices of the workers still alive."""
        ...

    def call(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` on every live worker; index -> result."""
        ...


class _LogProgress:
    def __init__(self, description: str, total: int) -> None:
        self._description = description

    def advance(self, stage: str) -> None:
        logger.info("%s: %s done", self._description, stage)

    def close(self) -> None:
        """Nothing to release."""


def _changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    changed = sum(
        int((a.view(torch.int16) != new[n].view(torch.int16)).sum()) for n, a in old.items()
    )
    return changed / max(1, sum(t.numel() for t in new.values()))


@dataclass
class _Demo:
    settings: DemoSettings
    trainer: DemoTrainer
    fleet: Fleet
    synchronizer: WeightSynchronizer
    progress: ProgressFactory
    report: DemoReport
    proxy: CorruptingRelayProxy | None = None

    @cached_property
    def prompts(self) -> list[list[int]]:
        """The prompts every worker generates from after each refit (the same every step)."""
        return self.trainer.prompts(self.settings.prompts, 8)

    def run(self) -> None:
        committed = self.trainer.engine_state()
        for step in range(1, self.settings.steps + 1):
            bar = self.progress(f"step {step}", len(STAGES))
            try:
                loss = self.trainer.train_step()
                bar.advance("train")
                state = self.trainer.engine_state()
                changed = _changed_fraction(committed, state)
                if step == self.settings.faulted_step:
                    self.report.records.append(self._faulted(step, loss, changed, committed))
                record = self._refit(step, loss, changed, state, bar)
                self.report.records.append(record)
                if record.outcome == "committed":
                    committed = state
            finally:
                bar.close()
        if self.settings.engine == "vllm":
            self._check_fresh_engine(committed)

    def _check_fresh_engine(self, committed: dict[str, torch.Tensor]) -> None:
        """vLLM's oracle: every engine's tokens now equal a fresh engine's on ``committed``
        (folded into the last record)."""
        fleet = cast("VllmFleet", self.fleet)
        prompts = self.prompts
        wanted = fleet.fresh_tokens(committed, prompts, self.settings.new_tokens)
        tokens = fleet.call("generate", prompts, self.settings.new_tokens)
        differ = sorted(i for i, t in tokens.items() if t != wanted)
        last = self.report.records[-1]
        note = (
            f"engines {differ} differ from a fresh vLLM engine on the final weights"
            if differ
            else "tokens equal a fresh vLLM engine's on the final weights"
        )
        self.report.records[-1] = replace(
            last,
            verified=last.verified and not differ,
            detail="; ".join(d for d in (last.detail, note) if d),
        )

    def _refit(
        self,
        step: int,
        loss: float,
        changed: float,
        state: dict[str, torch.Tensor],
        bar: Progress,
    ) -> RefitRecord:
        started = time.monotonic()
        try:
            if self.settings.inflight:
                result = self.synchronizer.commit_weights(self.synchronizer.stage_weights())
            else:
                result = self.synchronizer.sync_weights()
        except RefitError as exc:
            logger.error("step %d: refit failed: %s", step, exc)
            if self.synchronizer.is_stale():
                self.synchronizer.reconcile_communicator(())
            detail = f"refit failed: {type(exc).__name__}: {exc}"
            return RefitRecord(
                step,
                "failed",
                changed,
                0,
                0,
                time.monotonic() - started,
                False,
                loss,
                detail=detail,
            )
        refit_s = time.monotonic() - started
        bar.advance("refit")
        expected = state_digest(state.items())
        digests = self.fleet.call("state_digests") if self.fleet.exposes_bits else {}
        versions = self.fleet.call("served_version")
        bits_ok = all(d == expected for d in digests.values())
        versions_ok = all(v == result.version for v in versions.values())
        bar.advance("verify bits")
        prompts = self.prompts
        tokens = self.fleet.call("generate", prompts, self.settings.new_tokens)
        if self.settings.engine == "vllm":  # the engines agree; a fresh engine checks at the end
            wanted = tokens[self.fleet.live[0]]
        else:
            wanted = self.trainer.greedy(prompts, self.settings.new_tokens)
        tokens_ok = all(t == wanted for t in tokens.values())
        bar.advance("verify tokens")
        problems = [
            f"workers {sorted(i for i, d in digests.items() if d != expected)} differ bitwise"
            if not bits_ok
            else "",
            f"served versions {versions} != {result.version}" if not versions_ok else "",
            f"workers {sorted(i for i, t in tokens.items() if t != wanted)} generate other tokens"
            if not tokens_ok
            else "",
            "" if self.fleet.exposes_bits else "bits not exposed (checked: version, tokens)",
        ]
        return RefitRecord(
            step,
            "committed",
            changed,
            result.wire_bytes,
            result.dense_bytes,
            refit_s,
            bits_ok and versions_ok and tokens_ok,
            loss,
            detail="; ".join(p for p in problems if p),
            pause_s=result.timings_s.get("pause") if self.settings.inflight else None,
        )

    def _faulted(
        self, step: int, loss: float, changed: float, committed: dict[str, torch.Tensor]
    ) -> RefitRecord:
        fault = self.settings.fault
        assert fault is not None
        fleet = self._reference_fleet()
        before_versions = self.fleet.call("served_version")
        victim = 0 if fault == "corrupt" else fleet.live[-1]
        with self._injected(fault, victim):
            started = time.monotonic()
            try:
                self.synchronizer.sync_weights()
                error: RefitError | None = None
            except RefitError as exc:
                error = exc
            elapsed = time.monotonic() - started
        survivors_versions = self.fleet.call("served_version")
        rolls_back = self.settings.transport == "zmq_sparse"
        expected = state_digest(committed.items())
        digests = self.fleet.call("state_digests") if rolls_back else {}
        checks = {
            "the refit failed with a typed error": error is not None,
            "within the deadline": elapsed <= self.settings.timeout_s + _RELEASE_SLACK_S,
            "survivors serve the previous version": survivors_versions
            == {i: before_versions[i] for i in survivors_versions},
            "survivors hold the previous bits": all(d == expected for d in digests.values()),
            "a chunk was corrupted": fault != "corrupt" or self._proxy().corrupted > 0,
        }
        self._recover(fault, victim)
        failed = [name for name, ok in checks.items() if not ok]
        cause = f"{type(error).__name__}: {error}" if error is not None else "the refit committed"
        detail = f"{fault} on worker {victim}: {cause}" + (
            f"; NOT {', '.join(failed)}" if failed else ""
        )
        outcome = "rolled back" if rolls_back else "aborted"
        return RefitRecord(
            step, outcome, changed, 0, 0, elapsed, not failed, loss, fault, detail[:400]
        )

    def _reference_fleet(self) -> DemoFleet:
        """The fleet, where faults are injected (settings allow them on reference engines only)."""
        if self.settings.engine != "reference":
            raise RuntimeError("faults are injected into reference engines only")
        return cast("DemoFleet", self.fleet)

    @contextmanager
    def _injected(self, fault: str, victim: int) -> Iterator[None]:
        if fault == "kill-worker":
            kill(self._reference_fleet().pids[victim])
            self._reference_fleet().mark_dead(victim)
        elif fault == "kill-relay":
            self._reference_fleet().call_one(victim, "stop_relay")
        else:
            self._proxy().arm()
        yield

    def _proxy(self) -> CorruptingRelayProxy:
        if self.proxy is None:
            raise RuntimeError("the corrupt fault needs the proxy in front of relay 0")
        return self.proxy

    def _recover(self, fault: str, victim: int) -> None:
        if fault == "kill-worker":
            self.synchronizer.reconcile_communicator({victim})
        elif fault == "kill-relay":
            self._reference_fleet().restart_relay(victim, self.settings.timeout_s)
            self.synchronizer.reconcile_communicator(())
        elif self.synchronizer.is_stale():
            self.synchronizer.reconcile_communicator(())


def run_demo(settings: DemoSettings, progress: ProgressFactory = _LogProgress) -> DemoReport:
    """Start the trainer and the fleet, run every step with its refit, tear everything down."""
    report = DemoReport(settings.transport, settings.workers)
    with ExitStack() as stack:
        trainer = DemoTrainer(settings.model_config, TrainingConfig(lr=settings.lr))
        if settings.engine == "vllm":
            fleet, generation, proxy = _vllm_fleet(settings, trainer, stack)
        elif settings.transport == "dynamo":
            fleet, generation, proxy = _dynamo_fleet(settings, trainer, stack)
        else:
            fleet, generation, proxy = _reference_fleet(settings, trainer, stack)
        backend, transport = settings.factory_row
        synchronizer = create_weight_synchronizer(
            trainer,
            generation,
            backend,
            settings.colocated,
            train_cluster=LocalCluster(1),
            inference_cluster=LocalCluster(settings.workers),
            refit_timeout_s=settings.timeout_s,
            transport=transport,
        )
        stack.enter_context(synchronizer)
        demo = _Demo(settings, trainer, fleet, synchronizer, progress, report, proxy)
        if settings.inflight:
            report.serving = _serving_through(demo, cast("DemoFleet", fleet))
        else:
            demo.run()
    return report


def _serving_through(demo: _Demo, fleet: DemoFleet) -> ServingCounts:
    """Run the demo while clients keep every worker generating; what they were served."""
    load = ServingLoad(
        [fleet.workers[i] for i in fleet.live],
        demo.settings.model_config.vocab_size,
        seed=demo.trainer.training.checkpoint_seed,
        method="serve",
    )
    load.start()
    try:
        demo.run()
    finally:
        load.stop()
    return load.counts


def _reference_fleet(
    settings: DemoSettings, trainer: DemoTrainer, stack: ExitStack
) -> tuple[Fleet, Any, CorruptingRelayProxy | None]:
    """A local Ray cluster and reference-engine workers; the fleet is its own generation."""
    stack.enter_context(
        local_ray(settings.workers + 1, object_store_memory=128 * _MiB, log_to_driver=False)
    )
    from refit_lab.demo.workers import DemoFleet

    fleet = DemoFleet(settings.model_config, settings.workers, trainer.training.checkpoint_seed)
    stack.callback(fleet.close)
    proxy = None
    if settings.transport == "zmq_sparse":
        fleet.start_relays(settings.timeout_s)
    elif settings.transport == "ipc":
        fleet.start_ipc_receivers()
    if settings.fault == "corrupt":
        proxy = CorruptingRelayProxy(fleet.relay_address(0))
        stack.callback(proxy.close)
        fleet.route_relay(0, proxy.address)
    return fleet, fleet, proxy


def _dynamo_fleet(
    settings: DemoSettings, trainer: DemoTrainer, stack: ExitStack
) -> tuple[Fleet, Any, None]:
    """Dynamo worker processes on the trainer's initial checkpoint; their channel is the
    generation (no Ray: the Dynamo row drives the workers from threads)."""
    from refit_lab.demo.dynamo_fleet import DynamoDemoFleet
    from refit_lab.dynamo_lab.fleet import dynamo_fleet
    from refit_nccl import CollectiveOptions

    logs = Path(stack.enter_context(TemporaryDirectory(prefix="refit-demo-dynamo-")))
    seed = trainer.training.checkpoint_seed
    ready = stack.enter_context(dynamo_fleet(settings.workers, seed, logs, settings.model_config))
    # A worker's update call spans the whole transfer: it must outlast the refit's deadline.
    control_timeout_s = settings.timeout_s + CollectiveOptions().grace_s + _CONTROL_SLACK_S
    fleet = DynamoDemoFleet(ready(), control_timeout_s)
    stack.callback(fleet.close)
    return fleet, fleet.channel, None


def _vllm_fleet(
    settings: DemoSettings, trainer: DemoTrainer, stack: ExitStack
) -> tuple[Fleet, Any, None]:
    """vLLM engines on the trainer's initial weights, written as a Llama checkpoint."""
    from refit_lab.demo.vllm_fleet import VllmFleet

    folder = Path(stack.enter_context(TemporaryDirectory(prefix="refit-demo-")))
    fleet = VllmFleet(
        settings.model_config,
        folder,
        trainer.engine_state(),
        settings.workers,
        settings.transport,
        settings.timeout_s,
    )
    stack.callback(fleet.close)
    return fleet, fleet.generation, None
