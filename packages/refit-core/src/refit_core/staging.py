"""A version staged on every engine but not yet served (the first phase of a two-phase refit)."""

from __future__ import annotations

from dataclasses import dataclass

from refit_core.types import RefitResult

__all__ = ["StagedRefit"]


@dataclass(frozen=True)
class StagedRefit:
    """What :meth:`~refit_core.WeightSynchronizer.stage_weights` returns.

    Every engine holds ``version`` beside the one it serves, moved and verified; nothing is
    served from it until :meth:`~refit_core.WeightSynchronizer.commit_weights`.

    Attributes:
        version: the staged version.
        staging_id: names this staging on every engine (a commit or abort carries it).
        result: what staging moved: bytes, per-phase timings, per-engine outcome.
    """

    version: int
    staging_id: str
    result: RefitResult
