"""A synchronizer that copies a policy's dict of bytes into an engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from refit_core import (
    EngineHealth,
    EngineReport,
    EngineState,
    EngineStatus,
    FleetStatus,
    RefitResult,
    WeightSynchronizer,
    WorkerError,
    WorkerOutcome,
)
from refit_core.backend import Deadline, check_field_types, with_engines


@dataclass(frozen=True)
class ToyOptions:
    """How the toy copies: ``chunk_bytes`` per copy step (at least 1)."""

    chunk_bytes: int = 4

    def __post_init__(self) -> None:
        check_field_types(self)  # a field of the wrong type fails here, not at the first refit
        if self.chunk_bytes < 1:
            raise ValueError(f"ToyOptions.chunk_bytes must be >= 1, got {self.chunk_bytes}")


class ToyPolicy:
    """The trainer side: named bytes."""

    def __init__(self, weights: dict[str, bytes]) -> None:
        self.weights = dict(weights)


@dataclass
class ToyEngine:
    """The engine side: what it serves and at which version; ``broken`` refuses refits."""

    weights: dict[str, bytes] = field(default_factory=dict)
    version: int = 0
    broken: bool = False

    def load(self, weights: dict[str, bytes], version: int) -> None:
        """Serve ``weights`` at ``version``, all at once."""
        if self.broken:
            raise RuntimeError("the engine refuses new weights")
        self.weights, self.version = weights, version


LABEL = "toy engine"


class ToySynchronizer(WeightSynchronizer):
    """Copies ``policy.weights`` into ``engine`` chunk by chunk."""

    def __init__(
        self,
        policy: ToyPolicy,
        engine: ToyEngine,
        options: ToyOptions,
        meeting_point: tuple[str, int] | None,
        refit_timeout_s: float | None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        self.policy = policy
        self.engine = engine
        self.options = options
        self.meeting_point = meeting_point

    def _init_communicator(self, deadline: Deadline) -> None:
        deadline.check("connecting")

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        started = time.monotonic()
        copied: dict[str, bytes] = {}
        for name, data in self.policy.weights.items():
            step = self.options.chunk_bytes
            copied[name] = b"".join(data[i : i + step] for i in range(0, len(data), step))
            deadline.check("copying")
        try:
            self.engine.load(copied, version)
        except RuntimeError as exc:
            error = WorkerError(str(exc), worker=LABEL, operation="load")
            old = EngineReport(0, LABEL, EngineState.OLD, self.engine.version, str(exc))
            raise with_engines(error, [old]) from exc
        size = sum(len(v) for v in copied.values())
        return RefitResult(
            version=version,
            timings_s={"copy": time.monotonic() - started},
            total_s=time.monotonic() - started,
            wire_bytes=size,
            dense_bytes=size,
            workers=(WorkerOutcome(LABEL, True, version),),
        )

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """The hook behind ``status()`` and ``recover()``: the one engine, asked directly."""
        deadline.check("asking the engine")
        serving = EngineStatus(0, LABEL, EngineHealth.SERVING, self.engine.version)
        return FleetStatus((serving,))

    def _shutdown(self) -> None:
        self.engine.weights = {}
