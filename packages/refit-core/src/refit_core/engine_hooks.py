"""Notifications an engine may take around a refit, so it never serves tokens from mixed weights.

Every method is optional: an engine that has none still refits, but then it must not be
asked for tokens while a refit is writing its weights. The engine side of every row (the
collective endpoint, the relay's engine, the IPC receiver, ...) calls them through
:func:`notify`:

1. ``on_refit_begin(version)`` before the first byte of the engine's weights changes: stop
   generating at the next step boundary and hold new requests (do not abort them).
2. then exactly one of
   - ``on_refit_commit(version)``: the weights are complete at ``version``; the prefix cache
     was reset; resume serving, held requests included.
   - ``on_refit_abort(version, weights_changed=False)``: the weights are exactly the previous
     version again (rolled back, or never touched): resume serving.
   - ``on_refit_abort(version, weights_changed=True)``: the weights are partial: stay
     **closed** (generate nothing, keep holding requests) until a later ``on_refit_commit``.
"""

from __future__ import annotations

import logging
from typing import Protocol

__all__ = ["RefitHooks", "notify"]

logger = logging.getLogger(__name__)

HOOKS = ("on_refit_begin", "on_refit_abort", "on_refit_commit")


class RefitHooks(Protocol):
    """The full set of notifications (each one optional on a real engine)."""

    def on_refit_begin(self, version: int) -> object:
        """Weights are about to change: stop generating, hold requests."""
        ...

    def on_refit_abort(self, version: int, *, weights_changed: bool) -> object:
        """The refit to ``version`` failed; ``weights_changed``: the weights are partial."""
        ...

    def on_refit_commit(self, version: int) -> object:
        """The weights are complete at ``version``: serve again."""
        ...


def notify(engine: object, hook: str, version: int, **kwargs: bool) -> bool:
    """Call ``engine.<hook>(version, **kwargs)`` if the engine has it; whether it did.

    Raises:
        ValueError: ``hook`` is not one of the notifications.
        Exception: whatever the engine's hook raised (the caller fails the refit with it).
    """
    if hook not in HOOKS:
        raise ValueError(f"unknown refit hook {hook!r}; known: {', '.join(HOOKS)}")
    method = getattr(engine, hook, None)
    if method is None:
        return False
    logger.debug("%s(%d) on %s", hook, version, type(engine).__name__)
    method(version, **kwargs)
    return True
