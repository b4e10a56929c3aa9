"""The one error tree of refit.

Every error raised by refit derives from :class:`RefitError`; several also derive from the
builtin they refine (``TimeoutError``, ``ImportError``, ``ValueError``) so callers that catch
builtins keep working. ``is_retryable`` tells a controller whether the same refit may be tried
again (possibly after ``reconcile_communicator`` or a dense resync) or needs a human.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AuthenticationError",
    "BackendNotInstalledError",
    "ChecksumMismatchError",
    "GeometryMismatchError",
    "ProtocolError",
    "RefitAbortedError",
    "RefitError",
    "RefitTimeoutError",
    "StaleBaseError",
    "SynchronizerClosedError",
    "VerificationError",
    "WorkerError",
]


class RefitError(Exception):
    """Base of every refit error.

    Attributes:
        is_retryable: whether the same refit may be attempted again.
        wedged_workers: engines whose side of a transfer refit could not release (for
            example a Dynamo or SGLang process inside a collective); they need recovery.
    """

    is_retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        is_retryable: bool | None = None,
        wedged_workers: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        if is_retryable is not None:
            self.is_retryable = is_retryable
        self.wedged_workers: tuple[str, ...] = tuple(wedged_workers)


class RefitTimeoutError(RefitError, TimeoutError):
    """A refit (or one of its network or collective calls) passed its deadline."""

    is_retryable = True


class RefitAbortedError(RefitError):
    """A communicator was aborted; it is unusable until rebuilt."""

    is_retryable = True


class ChecksumMismatchError(RefitError, ValueError):
    """A payload's checksum did not match its contents; nothing was applied."""

    is_retryable = True


class StaleBaseError(RefitError):
    """A payload was built against another base version than the receiver holds."""

    is_retryable = True


class VerificationError(RefitError):
    """Applied weights differ from what the trainer sent (digest or sampled values)."""

    is_retryable = True


class GeometryMismatchError(RefitError, ValueError):
    """Sender and receiver disagree on the transfer plan (names, dtypes, shapes, buckets)."""


class ProtocolError(RefitError, ValueError):
    """A malformed or unexpected message was received."""


class AuthenticationError(RefitError, PermissionError):
    """A peer failed authentication."""


class WorkerError(RefitError):
    """An engine worker reported a failure.

    Attributes:
        worker: identity of the failing worker (instance id, address or rank).
        operation: what was being done (a route, an RPC name).
    """

    def __init__(
        self,
        message: str,
        *,
        worker: str,
        operation: str,
        is_retryable: bool | None = None,
    ) -> None:
        super().__init__(f"{worker}: {operation}: {message}", is_retryable=is_retryable)
        self.worker = worker
        self.operation = operation


class SynchronizerClosedError(RefitError, RuntimeError):
    """A synchronizer was used after ``shutdown()``."""


class BackendNotInstalledError(RefitError, ImportError):
    """A known backend row whose package is not installed.

    Attributes:
        install_hint: the exact ``pip install`` line that brings the package.
    """

    def __init__(self, message: str, *, install_hint: str) -> None:
        super().__init__(f"{message}; install it with: {install_hint}")
        self.install_hint = install_hint
