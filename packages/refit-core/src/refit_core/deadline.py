"""Deadlines that every network and collective call of a refit derives its timeout from."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from refit_core.errors import RefitTimeoutError

__all__ = ["Deadline", "probe_timeout_s"]


@dataclass(frozen=True)
class Deadline:
    """An absolute point on the monotonic clock, or no deadline at all (``at is None``)."""

    at: float | None

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline:
        """A deadline ``timeout_s`` seconds from now; ``None`` disarms it."""
        if timeout_s is None:
            return cls(None)
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        return cls(time.monotonic() + timeout_s)

    @classmethod
    def never(cls) -> Deadline:
        """A disarmed deadline."""
        return cls(None)

    @property
    def armed(self) -> bool:
        """Whether there is a deadline at all."""
        return self.at is not None

    def remaining_s(self) -> float | None:
        """Seconds left (never negative), or None when disarmed."""
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.at is not None and time.monotonic() >= self.at

    def timeout_for(self, call_timeout_s: float | None) -> float | None:
        """Timeout of one call: the smaller of its own timeout and what the deadline leaves."""
        left = self.remaining_s()
        if left is None:
            return call_timeout_s
        return left if call_timeout_s is None else min(left, call_timeout_s)

    def check(self, what: str) -> None:
        """Raise :class:`RefitTimeoutError` naming ``what`` if the deadline has passed."""
        if self.expired():
            raise RefitTimeoutError(f"deadline passed before {what}")


PROBE_S = (1.0, 2.0)
"""The bounds of a derived probe timeout (a tenth of the refit's deadline)."""


def probe_timeout_s(given_s: float | None, refit_timeout_s: float | None, *, name: str) -> float:
    """How long a status probe waits for each engine: ``given_s``, or a tenth of the refit's
    deadline within :data:`PROBE_S` (its upper bound without a deadline).

    Raises:
        ValueError: ``given_s`` is not positive, or above a quarter of the deadline (a fleet
            with a frozen engine could then not be asked and recovered within it); ``name``
            names the option in the message.
    """
    if given_s is None:
        low, high = PROBE_S
        return high if refit_timeout_s is None else min(high, max(low, refit_timeout_s / 10))
    if given_s <= 0:
        raise ValueError(f"{name} must be > 0, got {given_s}")
    if refit_timeout_s is not None and given_s > refit_timeout_s / 4:
        raise ValueError(
            f"{name}={given_s} does not fit a refit_timeout_s of {refit_timeout_s} (at most "
            "a quarter of it); leave it None to derive it"
        )
    return given_s
