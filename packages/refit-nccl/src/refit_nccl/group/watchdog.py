"""A one-shot watchdog: runs a callback from its own thread when a deadline passes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from refit_core.backend import Deadline

__all__ = ["Watchdog"]

logger = logging.getLogger(__name__)


class Watchdog:
    """Calls ``on_expiry()`` once if ``deadline`` passes while the watchdog is entered.

    Used where aborting a communicator from another thread releases a call blocked in it
    (NCCL). A disarmed deadline starts no thread.
    """

    def __init__(self, deadline: Deadline, on_expiry: Callable[[], None], *, what: str) -> None:
        self._deadline = deadline
        self._on_expiry = on_expiry
        self._what = what
        self._timer: threading.Timer | None = None
        self._fired = threading.Event()

    @property
    def fired(self) -> bool:
        """Whether the deadline passed and the callback ran."""
        return self._fired.is_set()

    def _fire(self) -> None:
        self._fired.set()
        logger.warning("watchdog: %s passed its deadline; aborting", self._what)
        try:
            self._on_expiry()
        except Exception:
            logger.exception("watchdog: abort after %s failed", self._what)

    def __enter__(self) -> Watchdog:
        remaining = self._deadline.remaining_s()
        if remaining is not None:
            self._timer = threading.Timer(remaining, self._fire)
            self._timer.name = f"refit-watchdog: {self._what}"
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
