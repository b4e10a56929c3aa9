"""The fleet as its engines report it: what each serves, and whether they agree.

``WeightSynchronizer.status()`` returns a :class:`FleetStatus`; ``recover()`` reads it to
decide what to drop, reopen and resync, and a new synchronizer adopts the version the live
engines agree on from it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EngineHealth", "EngineStatus", "FleetStatus"]


class EngineHealth(enum.StrEnum):
    """Whether an engine serves tokens.

    ``SERVING``: it generates from a complete version. ``CLOSED``: it generates nothing until
    a complete refit succeeds (a dense refit failed after it started writing). ``UNREACHABLE``:
    it did not answer (dead, frozen, partitioned).
    """

    SERVING = "serving"
    CLOSED = "closed"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class EngineStatus:
    """One engine as it reports itself.

    Attributes:
        shard: its shard index (what ``reconcile_communicator`` takes).
        worker: its label (relay address, actor label, instance id).
        health: serving, closed or unreachable.
        version: the version it serves (None when closed or unreachable).
        staged_version: a version moved and verified beside the served one, not yet
            committed (None when nothing is staged).
        detail: one line on why it is closed or unreachable.
    """

    shard: int
    worker: str
    health: EngineHealth
    version: int | None = None
    staged_version: int | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if (self.health is EngineHealth.SERVING) != (self.version is not None):
            raise ValueError(f"a serving engine has a version and only it does: {self}")


@dataclass(frozen=True)
class FleetStatus:
    """Every engine of a synchronizer's fleet, in shard order."""

    engines: tuple[EngineStatus, ...]

    @classmethod
    def of(cls, engines: Iterable[EngineStatus]) -> FleetStatus:
        """The status of ``engines``, sorted by shard."""
        return cls(tuple(sorted(engines, key=lambda e: (e.shard, e.worker))))

    def serving(self) -> dict[int, tuple[int, ...]]:
        """Version -> the shards serving it."""
        by_version: dict[int, list[int]] = {}
        for engine in self.engines:
            if engine.version is not None:
                by_version.setdefault(engine.version, []).append(engine.shard)
        return {v: tuple(shards) for v, shards in sorted(by_version.items())}

    def shards(self, health: EngineHealth) -> tuple[int, ...]:
        """The shards in ``health``."""
        return tuple(dict.fromkeys(e.shard for e in self.engines if e.health is health))

    @property
    def agreed_version(self) -> int | None:
        """The one version every serving engine serves; None when none serves or they differ."""
        versions = self.serving()
        return next(iter(versions)) if len(versions) == 1 else None

    @property
    def newest_version(self) -> int | None:
        """The highest version any engine serves."""
        versions = self.serving()
        return max(versions) if versions else None

    @property
    def consistent(self) -> bool:
        """Every engine serves, all the same version."""
        return bool(self.engines) and (
            all(e.health is EngineHealth.SERVING for e in self.engines)
            and self.agreed_version is not None
        )

    def describe(self) -> str:
        """One line: versions served, closed and unreachable shards."""
        parts = [f"version {v} on shards {list(s)}" for v, s in self.serving().items()]
        for health in (EngineHealth.CLOSED, EngineHealth.UNREACHABLE):
            shards = self.shards(health)
            if shards:
                parts.append(f"{health} shards {list(shards)}")
        return "; ".join(parts) or "no engines"
