"""The ``WeightSynchronizer`` ABC: one public template method per operation, one hook per backend."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import TypeVar

from refit_core.deadline import Deadline
from refit_core.errors import RefitError, RefitTimeoutError, SynchronizerClosedError
from refit_core.types import RefitResult, WeightVersion

__all__ = ["WeightSynchronizer"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class WeightSynchronizer(ABC):
    """Moves the trainer's weights into the inference engines, one versioned refit at a time.

    Public methods validate, time, log and wrap errors; backends implement the ``_``-prefixed
    hooks. Every refit gets a fresh :class:`Deadline` from ``refit_timeout_s`` (None disarms),
    which hooks pass down to each network or collective call. A synchronizer is not
    re-entrant: calls are serialized by an internal lock.
    """

    def __init__(self, *, refit_timeout_s: float | None = None) -> None:
        Deadline.after(refit_timeout_s)  # validates the value
        self.refit_timeout_s = refit_timeout_s
        self._version = WeightVersion(0)
        self._initialized = False
        self._closed = False
        self._lock = threading.RLock()

    # -- public template methods -------------------------------------------------------

    @property
    def version(self) -> int:
        """The weight version the engines serve after the last successful refit."""
        return self._version.value

    def init_communicator(self) -> None:
        """Set up the transport (groups, sockets, handles); idempotent."""
        with self._lock:
            self._require_open()
            if self._initialized:
                return
            started = time.monotonic()
            self._run_hook("init_communicator", lambda: self._init_communicator(self._deadline()))
            self._initialized = True
            logger.info(
                "%s: communicator ready in %.3f s", type(self).__name__, time.monotonic() - started
            )

    def sync_weights(self, version: int | None = None) -> RefitResult:
        """Run one refit to ``version`` (default: the current version + 1).

        Raises:
            ValueError: ``version`` does not increase.
            RefitTimeoutError: the refit passed ``refit_timeout_s``; the communicator is stale.
            RefitError: any other failure, with the backend's error as its cause.
        """
        with self._lock:
            self._require_open()
            target = self._version.next() if version is None else WeightVersion(version)
            self._version.require_advance_to(target)
            self.init_communicator()
            deadline = self._deadline()
            started = time.monotonic()
            logger.info("%s: refit to version %d", type(self).__name__, target.value)
            result = self._run_hook(
                f"refit to version {target.value}",
                lambda: self._sync_weights(target.value, deadline),
            )
            if result.version != target.value:
                raise RefitError(
                    f"backend reported version {result.version}, expected {target.value}"
                )
            self._version = target
            logger.info(
                "%s: version %d in %.3f s (%d wire bytes of %d dense)",
                type(self).__name__,
                target.value,
                time.monotonic() - started,
                result.wire_bytes,
                result.dense_bytes,
            )
            return result

    def is_stale(self) -> bool:
        """Whether the communicator must be rebuilt (``reconcile_communicator``) before a refit."""
        with self._lock:
            self._require_open()
            return self._is_stale()

    def reconcile_communicator(self, absent_shards: Collection[int] = ()) -> None:
        """Rebuild the communicator over the engine shards not in ``absent_shards``.

        A no-op when nothing changed and the communicator is healthy.
        """
        with self._lock:
            self._require_open()
            absent = frozenset(absent_shards)
            if any(s < 0 for s in absent):
                raise ValueError(f"shard indices must be >= 0, got {sorted(absent)}")
            self._run_hook(
                "reconcile_communicator",
                lambda: self._reconcile_communicator(absent, self._deadline()),
            )
            self._initialized = True

    def shutdown(self) -> None:
        """Release every resource; idempotent. Later calls raise SynchronizerClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            logger.info("%s: shutting down", type(self).__name__)
            self._shutdown()

    def __enter__(self) -> WeightSynchronizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- hooks ------------------------------------------------------------------------

    @abstractmethod
    def _init_communicator(self, deadline: Deadline) -> None:
        """Build the transport; called once before the first refit and never after shutdown."""

    @abstractmethod
    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        """Move the weights, verify them, commit ``version`` on every engine."""

    def _is_stale(self) -> bool:
        """Whether the communicator needs a rebuild; False for transports without one."""
        return False

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        """Rebuild over survivors. Transports without membership refuse absent shards."""
        if absent_shards:
            raise NotImplementedError(
                f"{type(self).__name__} has no membership to reconcile (absent {sorted(absent_shards)})"
            )

    @abstractmethod
    def _shutdown(self) -> None:
        """Release resources; called at most once."""

    # -- helpers ----------------------------------------------------------------------

    def _deadline(self) -> Deadline:
        return Deadline.after(self.refit_timeout_s)

    def _require_open(self) -> None:
        if self._closed:
            raise SynchronizerClosedError(f"{type(self).__name__} was shut down")

    def _run_hook(self, what: str, hook: Callable[[], _T]) -> _T:
        try:
            return hook()
        except RefitError:
            logger.warning("%s: %s failed", type(self).__name__, what, exc_info=True)
            raise
        except TimeoutError as exc:
            logger.warning("%s: %s timed out", type(self).__name__, what, exc_info=True)
            raise RefitTimeoutError(f"{what} timed out: {exc}") from exc
        except (ValueError, NotImplementedError):
            raise
        except Exception as exc:
            logger.warning("%s: %s failed", type(self).__name__, what, exc_info=True)
            raise RefitError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
