"""A synchronizer that copies a policy's dict of bytes into an engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from refit_core import RefitResult, WeightSynchronizer, WorkerOutcome
from refit_core.backend import Deadline


@dataclass(frozen=True)
class ToyOptions:
    """How the toy copies: ``chunk_bytes`` per copy step."""

    chunk_bytes: int = 4


class ToyPolicy:
    """The trainer side: named bytes."""

    def __init__(self, weights: dict[str, bytes]) -> None:
        self.weights = dict(weights)


@dataclass
class ToyEngine:
    """The engine side: what it serves and at which version."""

    weights: dict[str, bytes] = field(default_factory=dict)
    version: int = 0


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
        self.engine.weights, self.engine.version = copied, version
        size = sum(len(v) for v in copied.values())
        return RefitResult(
            version=version,
            timings_s={"copy": time.monotonic() - started},
            total_s=time.monotonic() - started,
            wire_bytes=size,
            dense_bytes=size,
            workers=(WorkerOutcome("toy engine", True, version),),
        )

    def _shutdown(self) -> None:
        self.engine.weights = {}
