"""What surrounds every refit of an SGLang engine: pause generation, flush the cache after
the new weights are in, and continue generation in a ``finally``."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from refit_core.backend import Deadline
from refit_sglang.client import SGLangClient

__all__ = [
    "LIFECYCLE_ROUTES",
    "REFIT_PAUSE_MODES",
    "PauseMode",
    "check_pause_mode",
    "flush_caches",
    "paused",
]

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract"]
"""Pause modes a refit may use; SGLang's ``in_place`` keeps KV computed with old weights."""

REFIT_PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract")

LIFECYCLE_ROUTES = ("pause_generation", "flush_cache", "continue_generation")
"""The routes every refit calls around moving the weights."""


def check_pause_mode(mode: str) -> PauseMode:
    """``mode`` if a refit may pause with it.

    Raises:
        ValueError: ``in_place`` (it keeps KV computed with the old weights) or an unknown mode.
    """
    if mode == "in_place":
        raise ValueError(
            "pause mode 'in_place' is refused for refit: requests keep KV cache computed with "
            "the old weights; use 'abort' or 'retract'"
        )
    if mode not in REFIT_PAUSE_MODES:
        raise ValueError(f"unknown pause mode {mode!r}; use one of {REFIT_PAUSE_MODES}")
    return mode


@contextmanager
def paused(
    clients: Sequence[SGLangClient], mode: PauseMode, deadline: Deadline, control_timeout_s: float
) -> Iterator[set[SGLangClient]]:
    """Pause generation on every client for the block; continue those that paused, unless
    the block put them in the set it is given: those stay paused (closed), because they may
    hold part of the new weights, or are still inside an update refit could not end.

    A failure to continue is raised after the block unless the block itself failed (then it
    is logged, and the block's error wins).
    """
    resumed: list[SGLangClient] = []
    closed: set[SGLangClient] = set()
    try:
        for client in clients:
            client.call("pause_generation", {"mode": mode}, deadline.timeout_for(control_timeout_s))
            resumed.append(client)
        yield closed
    except BaseException:
        _continue([c for c in resumed if c not in closed], control_timeout_s, raising=False)
        raise
    _continue([c for c in resumed if c not in closed], control_timeout_s, raising=True)


def _continue(clients: Sequence[SGLangClient], timeout_s: float, *, raising: bool) -> None:
    failure: Exception | None = None
    for client in clients:
        try:
            client.call("continue_generation", {}, timeout_s)
        except Exception as exc:
            logger.error("%s: continue_generation failed: %s", client.label, exc)
            failure = failure or exc
    if failure is not None and raising:
        raise failure


def flush_caches(
    clients: Sequence[SGLangClient], deadline: Deadline, control_timeout_s: float
) -> None:
    """Flush every client's prefix (radix) cache."""
    for client in clients:
        client.call("flush_cache", {}, deadline.timeout_for(control_timeout_s))
