"""Deadlines that every network and collective call of a refit derives its timeout from.

A refit's deadline is made once, at the public entry point, from a timeout checked by
:func:`checked_timeout_s` (the one rule: None, or a positive finite number of seconds), and
passed explicitly to every internal call. It crosses processes in one form,
:meth:`Deadline.to_wire` / :meth:`Deadline.from_wire`: the seconds left (monotonic clocks of
two processes or hosts do not agree, so an absolute time would not travel).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from refit_core.errors import InvalidTimeoutError, ProtocolError, RefitTimeoutError

__all__ = ["Deadline", "checked_timeout_s", "probe_timeout_s"]


def checked_timeout_s(name: str, value: object) -> float | None:
    """``value`` as a timeout in seconds, by the one rule every timeout refit is given
    follows: None (no deadline) or a positive finite number (a bool is not one).

    Raises:
        InvalidTimeoutError: anything else; the message names ``name`` and the value.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidTimeoutError(
            f"{name} must be None or a positive finite number of seconds, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class Deadline:
    """An absolute point on the monotonic clock, or no deadline at all (``at is None``)."""

    at: float | None

    @classmethod
    def after(cls, timeout_s: float | None, *, name: str = "timeout_s") -> Deadline:
        """A deadline ``timeout_s`` seconds from now; ``None`` disarms it.

        Raises:
            InvalidTimeoutError: ``timeout_s`` breaks :func:`checked_timeout_s`'s rule (the
                message names it ``name``).
        """
        checked = checked_timeout_s(name, timeout_s)
        return cls(None if checked is None else time.monotonic() + checked)

    @classmethod
    def from_wire(cls, left_s: object) -> Deadline:
        """The deadline a peer sent as :meth:`to_wire`, counted from its arrival here (0:
        already passed; None: disarmed).

        Raises:
            ProtocolError: ``left_s`` is not None or a non-negative finite number.
        """
        if left_s is None:
            return cls(None)
        if (
            isinstance(left_s, bool)
            or not isinstance(left_s, int | float)
            or not math.isfinite(left_s)
            or left_s < 0
        ):
            raise ProtocolError(
                f"a deadline on the wire is None or the seconds left (>= 0), got {left_s!r}"
            )
        return cls(time.monotonic() + left_s)

    @classmethod
    def never(cls) -> Deadline:
        """A disarmed deadline."""
        return cls(None)

    @property
    def armed(self) -> bool:
        """Whether there is a deadline at all."""
        return self.at is not None

    def to_wire(self) -> float | None:
        """The deadline as it crosses a process boundary: the seconds left (0 once passed),
        or None when disarmed; :meth:`from_wire` reads it back."""
        return self.remaining_s()

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
