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
        began_version: the highest version a refit ever began on it (committed or not,
            remembered while it is closed); None when it cannot say (unreachable).
    """

    shard: int
    worker: str
    health: EngineHealth
    version: int | None = None
    staged_version: int | None = None
    detail: str | None = None
    began_version: int | None = None

    def __post_init__(self) -> None:
        if (self.health is EngineHealth.SERVING) != (self.version is not None):
            raise ValueError(f"a serving engine has a version and only it does: {self}")


@dataclass(frozen=True)
class FleetStatus:
    """Every engine of a synchronizer's fleet, in shard order.

    Attributes:
        engines: each engine as it reported itself.
        left_out: the shards the synchronizer's communicator leaves out (dropped by
            ``recover()`` or ``reconcile_communicator``); their engines are asked too, so
            one that answers again shows in :attr:`returned`.
    """

    engines: tuple[EngineStatus, ...]
    left_out: tuple[int, ...] = ()

    @classmethod
    def of(cls, engines: Iterable[EngineStatus], left_out: Iterable[int] = ()) -> FleetStatus:
        """The status of ``engines``, sorted by shard."""
        ordered = tuple(sorted(engines, key=lambda e: (e.shard, e.worker)))
        return cls(ordered, tuple(sorted(set(left_out))))

    def serving(self) -> dict[int, tuple[int, ...]]:
        """Version -> the shards serving it (a shard of several workers named once)."""
        by_version: dict[int, dict[int, None]] = {}
        for engine in self.engines:
            if engine.version is not None:
                by_version.setdefault(engine.version, {})[engine.shard] = None
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
    def high_water_mark(self) -> int | None:
        """The highest version any engine serves, staged or ever began: a new version must
        be above it (versions are never reused)."""
        seen = [
            v
            for e in self.engines
            for v in (e.version, e.staged_version, e.began_version)
            if v is not None
        ]
        return max(seen) if seen else None

    @property
    def returned(self) -> tuple[int, ...]:
        """Left-out shards whose engines answer again (``recover()`` takes them back in,
        with a dense resync)."""
        answering = {e.shard for e in self.engines if e.health is not EngineHealth.UNREACHABLE}
        return tuple(s for s in self.left_out if s in answering)

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
        if self.left_out:
            parts.append(f"left out shards {list(self.left_out)}")
        return "; ".join(parts) or "no engines"
