"""Timings that add up: a refit's ``total_s`` is the whole ``sync_weights`` call, and its
``timings_s`` name the phases it spent the time in, the engine's load included."""

from __future__ import annotations

import time
from collections.abc import Sequence

from refit_core import RefitResult, WeightSynchronizer

UNNAMED = 0.05
"""The share of ``total_s`` that may pass in no named phase."""


def timings_add_up(
    synchronizer: WeightSynchronizer, version: int, phases: Sequence[str]
) -> RefitResult:
    """One refit through ``synchronizer``: its ``total_s`` spans the call (timed here), and the
    row's sequential ``phases`` (named in ``timings_s``) cover all of it but ``UNNAMED``."""
    started = time.perf_counter()
    result = synchronizer.sync_weights(version)
    wall_s = time.perf_counter() - started
    timings = result.timings_s
    assert (1 - UNNAMED) * wall_s <= result.total_s <= wall_s, (result.total_s, wall_s)
    assert set(phases) <= set(timings), timings
    named = sum(timings[p] for p in phases)
    assert named <= result.total_s * 1.001, timings
    assert named >= (1 - UNNAMED) * result.total_s, (timings, result.total_s)
    return result
