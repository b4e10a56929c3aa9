"""The conformance suite every backend's tests subclass.

A backend test subclasses :class:`SynchronizerConformance` and implements
``create_deployment``: a :class:`RefitDeployment` wiring a :class:`SimulatedTrainer` to
reference engines (or real ones) through the backend's synchronizer. The suite then checks
what every synchronizer owes its users: bitwise delivery, generations that match the
trainer's own forward pass (so stale prefix caches are caught), monotonic versions, a
harmless no-op reconcile and a final, idempotent shutdown. Each check is also a plain
function, so a test can show that the suite catches a broken backend.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from refit_core import RefitResult, SynchronizerClosedError, WeightSynchronizer
from refit_lab.digest import state_digest
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_lab.trainer import SimulatedTrainer

__all__ = [
    "PROMPTS",
    "EngineWorkerProbes",
    "FleetDeployment",
    "RefitDeployment",
    "SynchronizerConformance",
    "WorkerFleet",
    "check_bitwise_delivery",
    "check_generation_matches_trainer",
    "check_noop_reconcile",
    "check_shutdown_is_final",
    "check_versions_increase",
    "trainer_generation",
]

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4), (5, 6, 7), (1, 2, 3, 4, 9, 9))
MAX_NEW_TOKENS = 6


@dataclass
class RefitDeployment(ABC):
    """A trainer, its engines and the synchronizer between them, as a backend test builds it."""

    trainer: SimulatedTrainer
    synchronizer: WeightSynchronizer
    config: ReferenceModelConfig = field(default_factory=ReferenceModelConfig)

    @abstractmethod
    def engine_digests(self) -> list[dict[str, int]]:
        """Per engine, the bitwise digests of its real weights under checkpoint names."""

    @abstractmethod
    def engine_versions(self) -> list[int]:
        """Per engine, the weight version it reports."""

    @abstractmethod
    def engine_generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[list[int]]]:
        """Per engine, greedy continuations of ``prompts``."""

    def close(self) -> None:
        """Release the deployment (the synchronizer, engines, actors)."""
        self.synchronizer.shutdown()


class WorkerFleet(Protocol):
    """Reference-engine workers (Ray actors, say) answering one method on every worker."""

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every worker, their answers in worker order."""
        ...


class EngineWorkerProbes:
    """What a :class:`WorkerFleet`'s workers answer about their reference engine (``engine``):
    a base for the test workers that run as Ray actors."""

    engine: ReferenceEngine

    def state_digests(self) -> dict[str, int]:
        """The engine's per-tensor digests."""
        return self.engine.state_digests()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens of every prompt."""
        return self.engine.generate(prompts, max_new_tokens).tokens

    def weight_version(self) -> int:
        """The version the engine serves."""
        return self.engine.weight_version

    def pid(self) -> int:
        """The worker's process id (tests kill or freeze it)."""
        return os.getpid()


@dataclass
class FleetDeployment(RefitDeployment):
    """A deployment whose engines are a :class:`WorkerFleet` of reference-engine workers
    serving ``state_digests``, ``weight_version`` and ``generate``."""

    fleet: WorkerFleet | None = None

    def _call(self, method: str, *args: Any) -> list[Any]:
        if self.fleet is None:
            raise ValueError("FleetDeployment needs its fleet")
        return self.fleet.call(method, *args)

    def engine_digests(self) -> list[dict[str, int]]:
        return self._call("state_digests")

    def engine_versions(self) -> list[int]:
        return self._call("weight_version")

    def engine_generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[list[int]]]:
        return self._call("generate", prompts, max_new_tokens)


def trainer_generation(
    trainer: SimulatedTrainer,
    config: ReferenceModelConfig,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[list[int]]:
    """Greedy continuations computed from the trainer's own weights by a fresh engine."""
    engine = ReferenceEngine(config)
    engine.load_weights(trainer.engine_state().items())
    return engine.generate(prompts, max_new_tokens).tokens


def _refit(deployment: RefitDeployment) -> RefitResult:
    deployment.trainer.step()
    result = deployment.synchronizer.sync_weights()
    assert result.ok, f"refit reported failed workers: {result.workers}"
    return result


def check_bitwise_delivery(deployment: RefitDeployment) -> None:
    """After a refit every engine holds exactly the trainer's bits."""
    result = _refit(deployment)
    expected = state_digest(deployment.trainer.engine_state().items())
    for index, digests in enumerate(deployment.engine_digests()):
        wrong = sorted(name for name in expected if digests.get(name) != expected[name])
        assert not wrong, f"engine {index} differs from the trainer in {wrong}"
        assert set(digests) == set(expected), f"engine {index} holds other tensors"
    dense = sum(t.numel() * t.element_size() for t in deployment.trainer.engine_state().values())
    assert result.dense_bytes == dense, f"dense_bytes {result.dense_bytes} != {dense}"


def check_generation_matches_trainer(deployment: RefitDeployment) -> None:
    """Generations after a refit equal the trainer's; cached prefixes must not survive a refit."""
    deployment.engine_generate(PROMPTS, MAX_NEW_TOKENS)  # fill the engines' prefix caches
    _refit(deployment)
    expected = trainer_generation(deployment.trainer, deployment.config)
    for index, tokens in enumerate(deployment.engine_generate(PROMPTS, MAX_NEW_TOKENS)):
        assert tokens == expected, f"engine {index} generated {tokens}, trainer {expected}"


def check_versions_increase(deployment: RefitDeployment) -> None:
    """Each refit raises the version on every engine; an old version is refused."""
    before = deployment.synchronizer.version
    first = _refit(deployment)
    second = _refit(deployment)
    assert (first.version, second.version) == (before + 1, before + 2)
    assert deployment.engine_versions() == [second.version] * len(deployment.engine_versions())
    with pytest.raises(ValueError, match="must increase"):
        deployment.synchronizer.sync_weights(version=first.version)
    assert deployment.synchronizer.version == second.version


def check_noop_reconcile(deployment: RefitDeployment) -> None:
    """Reconciling with nobody absent changes nothing and the next refit succeeds."""
    _refit(deployment)
    deployment.synchronizer.reconcile_communicator(())
    assert not deployment.synchronizer.is_stale()
    check_bitwise_delivery(deployment)


def check_shutdown_is_final(deployment: RefitDeployment) -> None:
    """Shutdown is idempotent and every later use raises SynchronizerClosedError."""
    deployment.synchronizer.shutdown()
    deployment.synchronizer.shutdown()
    with pytest.raises(SynchronizerClosedError):
        deployment.synchronizer.sync_weights()
    with pytest.raises(SynchronizerClosedError):
        deployment.synchronizer.reconcile_communicator(())


class SynchronizerConformance(ABC):
    """Subclass in a backend's tests and implement :meth:`create_deployment`."""

    @abstractmethod
    def create_deployment(self) -> RefitDeployment:
        """A fresh deployment whose engines start on weights other than the trainer's."""

    @pytest.fixture
    def deployment(self) -> Iterator[RefitDeployment]:
        created = self.create_deployment()
        try:
            yield created
        finally:
            created.close()

    def test_bitwise_delivery(self, deployment: RefitDeployment) -> None:
        check_bitwise_delivery(deployment)

    def test_generation_matches_trainer(self, deployment: RefitDeployment) -> None:
        check_generation_matches_trainer(deployment)

    def test_versions_increase(self, deployment: RefitDeployment) -> None:
        check_versions_increase(deployment)

    def test_noop_reconcile(self, deployment: RefitDeployment) -> None:
        check_noop_reconcile(deployment)

    def test_shutdown_is_final(self, deployment: RefitDeployment) -> None:
        check_shutdown_is_final(deployment)
