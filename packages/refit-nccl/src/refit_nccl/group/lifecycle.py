"""A group's lifecycle: what it holds, whether it may still be used (:class:`GroupLifecycle`)."""

from __future__ import annotations

import logging
import threading

from torch._C._distributed_c10d import TCPStore

from refit_core import RefitAbortedError
from refit_nccl.group.traits import BackendTraits, Communicator

__all__ = ["GroupLifecycle"]

logger = logging.getLogger(__name__)


class GroupLifecycle:
    """A group's communicator and store, its backend's traits, the calls in flight, and the
    cause of its first abort. Safe from any thread.

    Once aborted, the group is unusable for good: every later call raises
    :class:`~refit_core.RefitAbortedError` naming the first cause, and the communicator and
    store are dropped as soon as no call is in flight (an abort never waits on peers).

    Args:
        label: how messages name the group's member.
        traits: the backend's traits, or None until the members agree on one at connect.
    """

    def __init__(self, label: str, traits: BackendTraits | None) -> None:
        self.label = label
        self.traits = traits
        self._lock = threading.Lock()
        self._communicator: Communicator | None = None
        self._store: TCPStore | None = None
        self._abort_cause: str | None = None
        self._in_flight = 0

    @property
    def known_traits(self) -> BackendTraits:
        """The backend's traits; RuntimeError before the members agreed on one."""
        if self.traits is None:
            raise RuntimeError(f"{self.label}: the backend is agreed at connect()")
        return self.traits

    @property
    def holds_communicator(self) -> bool:
        """Whether a communicator was installed and not dropped yet."""
        with self._lock:
            return self._communicator is not None

    @property
    def connected(self) -> bool:
        """Whether it holds a communicator and was not aborted."""
        with self._lock:
            return self._communicator is not None and self._abort_cause is None

    @property
    def abort_cause(self) -> str | None:
        """Why the group was aborted, or None."""
        return self._abort_cause

    def install(self, communicator: Communicator, store: TCPStore | None) -> None:
        """Hold a freshly built communicator and its store (dropped if aborted meanwhile)."""
        with self._lock:
            if self._abort_cause is None:
                self._communicator, self._store = communicator, store

    def raise_if_aborted(self, what: str) -> None:
        """Raise RefitAbortedError, naming the first cause, if the group was aborted."""
        if self._abort_cause is not None:
            raise RefitAbortedError(
                f"{self.label}: {what} on an aborted group (cause: {self._abort_cause})"
            )

    def enter_call(self, what: str) -> Communicator:
        """The communicator for a call that starts now; :meth:`leave_call` when it ended.

        Raises:
            RefitAbortedError: the group was aborted.
            RuntimeError: the group is not connected yet.
        """
        with self._lock:
            self.raise_if_aborted(what)
            communicator = self._communicator
            if communicator is None:
                raise RuntimeError(f"{self.label}: {what} before connect()")
            self._in_flight += 1
            return communicator

    def leave_call(self) -> None:
        """A call entered with :meth:`enter_call` ended."""
        with self._lock:
            self._in_flight -= 1
            self._release_if_idle()

    def abort(self, cause: str) -> None:
        """Make the group unusable; idempotent (the first cause stays), never blocks on
        peers: the backend's abort is called, never destroy."""
        with self._lock:
            if self._abort_cause is not None:
                return
            self._abort_cause = cause
            communicator = self._communicator
        logger.info("%s: aborted: %s", self.label, cause)
        if communicator is not None:
            try:
                communicator.abort()
            except Exception:
                logger.debug("%s: backend abort failed", self.label, exc_info=True)
        with self._lock:
            self._release_if_idle()

    def _release_if_idle(self) -> None:
        """Drop communicator and store once aborted and idle (lock held)."""
        if self._abort_cause is not None and self._in_flight == 0:
            self._communicator = None
            self._store = None
