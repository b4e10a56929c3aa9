"""Whether an engine may generate: open, paused by a refit, or closed on partial weights.

The reference engine keeps one :class:`ServingGate` and drives it from refit's engine
notifications (:mod:`refit_core.engine_hooks`): a refit that begins writing pauses it, a
commit opens it, an abort opens it again only when the weights are exactly the old ones and
otherwise closes it until the next commit. Generation waits at the gate.
"""

from __future__ import annotations

import enum
import threading
import time

__all__ = ["EngineClosedError", "GateState", "ServingGate"]


class EngineClosedError(RuntimeError):
    """The engine generates nothing now: a refit is writing its weights, or one failed after
    it started writing and no complete refit has reopened it."""


class GateState(enum.StrEnum):
    """``OPEN``: serving. ``PAUSED``: a refit is writing. ``CLOSED``: weights are partial."""

    OPEN = "open"
    PAUSED = "paused"
    CLOSED = "closed"


class ServingGate:
    """A thread-safe gate in front of generation."""

    def __init__(self) -> None:
        self._state = GateState.OPEN
        self._reason = ""
        self._changed = threading.Condition()

    @property
    def state(self) -> GateState:
        """The gate's state now."""
        return self._state

    def pause(self, reason: str) -> None:
        """Stop new generation (a refit begins writing)."""
        self._set(GateState.PAUSED, reason)

    def close(self, reason: str) -> None:
        """Generate nothing until :meth:`open` (the weights are partial)."""
        self._set(GateState.CLOSED, reason)

    def open(self) -> None:
        """Serve again."""
        self._set(GateState.OPEN, "")

    def wait_open(self, wait_s: float) -> None:
        """Return once the gate is open, waiting at most ``wait_s``.

        Raises:
            EngineClosedError: still paused or closed after ``wait_s``.
        """
        self._wait(wait_s, closed_ends=False)

    def hold(self, wait_s: float) -> None:
        """Hold a request in flight through a pause: return once the gate is open, waiting at
        most ``wait_s``.

        Raises:
            EngineClosedError: the gate closed (at once), or was still paused after ``wait_s``.
        """
        self._wait(wait_s, closed_ends=True)

    def _wait(self, wait_s: float, *, closed_ends: bool) -> None:
        end = time.monotonic() + wait_s
        with self._changed:
            while self._state is not GateState.OPEN:
                left = end - time.monotonic()
                if left <= 0 or (closed_ends and self._state is GateState.CLOSED):
                    raise EngineClosedError(f"engine {self._state.value}: {self._reason}")
                self._changed.wait(left)

    def _set(self, state: GateState, reason: str) -> None:
        with self._changed:
            self._state, self._reason = state, reason
            self._changed.notify_all()
