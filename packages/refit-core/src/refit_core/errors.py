"""The one error tree of refit, with the structured facts a controller acts on.

Every error raised by refit derives from :class:`RefitError`; several also derive from the
builtin they refine (``TimeoutError``, ``ImportError``, ``ValueError``) so callers that catch
builtins keep working. Besides its one-line message, an error says what a program needs to
recover without parsing text:

- ``recovery``: what makes the next refit succeed (:class:`Recovery`): retry as is, recover
  first (drop the dead, reopen the closed, rebuild the communicator), a dense resync, or a
  fix by a person (bad input or configuration). ``is_retryable`` is True exactly when a plain
  retry may succeed.
- ``engines``: each engine's state after the failure (:class:`EngineReport`: old, new,
  closed or unknown, by shard index and label), where the backend knows it.
- ``wedged_workers``: engines whose side of a transfer refit could not release.

Underlying exceptions are chained (``raise ... from``), never concatenated into the message.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AuthenticationError",
    "BackendNotInstalledError",
    "ChecksumMismatchError",
    "DeadlineTooShortError",
    "EngineReport",
    "EngineState",
    "GeometryMismatchError",
    "InvalidTimeoutError",
    "ProtocolError",
    "Recovery",
    "RefitAbortedError",
    "RefitError",
    "RefitTimeoutError",
    "StaleBaseError",
    "SynchronizerClosedError",
    "VerificationError",
    "WorkerError",
    "refit_error_type",
    "with_engines",
]


class EngineState(enum.StrEnum):
    """What an engine serves after a refit failed.

    ``OLD``: exactly its previous version (rolled back, or never touched). ``NEW``: the
    refit's target version (it committed before the failure elsewhere). ``CLOSED``: nothing
    until a complete refit succeeds (it may hold partial weights; it generates no token).
    ``UNKNOWN``: it could not be asked (dead, frozen, unreachable).
    """

    OLD = "old"
    NEW = "new"
    CLOSED = "closed"
    UNKNOWN = "unknown"


class Recovery(enum.StrEnum):
    """What must happen before the next refit can succeed.

    ``RETRY``: nothing; the same call may succeed as is. ``RECOVER``: call the
    synchronizer's ``recover()`` first (it drops dead engines, rebuilds the communicator,
    reopens closed engines with a dense resync). ``RESYNC``: the next refit must be a dense
    resync (``recover()`` arranges it). ``FIX``: a person must change the input or the
    configuration (a wrong geometry, a key, a bad argument); retrying cannot help.
    """

    RETRY = "retry"
    RECOVER = "recover"
    RESYNC = "resync"
    FIX = "fix"


@dataclass(frozen=True)
class EngineReport:
    """One engine after a failed refit.

    Attributes:
        shard: the engine's shard index (what ``reconcile_communicator`` takes), when known.
        worker: the engine's label (a relay address, an actor label, an instance id).
        state: what it serves now.
        version: the version it serves (None when closed or unknown).
        reason: one line on what went wrong there (None when nothing did).
    """

    shard: int | None
    worker: str
    state: EngineState
    version: int | None = None
    reason: str | None = None

    @property
    def failed(self) -> bool:
        """Whether something went wrong on this engine."""
        return self.reason is not None or self.state in (EngineState.CLOSED, EngineState.UNKNOWN)


class RefitError(Exception):
    """Base of every refit error.

    Attributes:
        recovery: what makes the next refit succeed (see :class:`Recovery`).
        is_retryable: whether the same refit may succeed if simply attempted again.
        wedged_workers: engines whose side of a transfer refit could not release (for
            example a Dynamo or SGLang process inside a collective); they need recovery.
        engines: each engine's state after the failure, where the backend knows it.
        progress: the share of the transfer's bytes (0 to 1) the participant that raised it
            had moved when it failed, where it knows it (None: unknown).
    """

    recovery: Recovery = Recovery.FIX
    progress: float | None = None

    def __init__(
        self,
        message: str,
        *,
        is_retryable: bool | None = None,
        recovery: Recovery | None = None,
        wedged_workers: Sequence[str] = (),
        engines: Sequence[EngineReport] = (),
    ) -> None:
        super().__init__(message)
        if recovery is not None:
            self.recovery = recovery
        elif is_retryable is not None:
            self.recovery = Recovery.RETRY if is_retryable else Recovery.FIX
        self.wedged_workers: tuple[str, ...] = tuple(wedged_workers)
        self.engines: tuple[EngineReport, ...] = tuple(engines)

    @property
    def is_retryable(self) -> bool:
        """Whether a plain retry (no ``recover()``, no resync) may succeed."""
        return self.recovery is Recovery.RETRY

    @property
    def failed_shards(self) -> tuple[int, ...]:
        """Shard indices of the engines something went wrong on."""
        return tuple(e.shard for e in self.engines if e.failed and e.shard is not None)

    def states(self) -> dict[str, EngineState]:
        """Engine label -> its state after the failure."""
        return {e.worker: e.state for e in self.engines}

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields survive pickling (Ray ships errors between processes).
        return (_restore, (type(self), self.args, dict(self.__dict__)))


def _restore(
    cls: type[RefitError], args: tuple[object, ...], state: dict[str, object]
) -> RefitError:
    """Rebuild a pickled refit error without calling its ``__init__``."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class RefitTimeoutError(RefitError, TimeoutError):
    """A refit (or one of its network or collective calls) passed its deadline."""

    recovery = Recovery.RECOVER


class DeadlineTooShortError(RefitTimeoutError):
    """The refit's deadline passed while every participant was alive and moving bytes: the
    transfer needs more time than ``refit_timeout_s`` gives it. No retry or recovery fixes
    that (``Recovery.FIX``): raise the deadline (or shrink the transfer).

    Attributes:
        deadline_s: the deadline the refit had.
        needed_s: the time the transfer needed, measured from the share of it that moved by
            the deadline (None: nothing moved, so only "more than ``deadline_s``" is known).
    """

    recovery = Recovery.FIX

    def __init__(
        self,
        message: str,
        *,
        deadline_s: float,
        needed_s: float | None,
        engines: Sequence[EngineReport] = (),
    ) -> None:
        super().__init__(message, engines=engines)
        self.deadline_s = deadline_s
        self.needed_s = needed_s

    @classmethod
    def measured(
        cls,
        what: str,
        *,
        deadline_s: float,
        elapsed_s: float,
        progress: float | None,
        engines: Sequence[EngineReport] = (),
    ) -> DeadlineTooShortError:
        """The error for ``what``, which moved ``progress`` of its bytes in ``elapsed_s``
        before the deadline of ``deadline_s`` passed: the time it needed, from that rate."""
        needed = elapsed_s / progress if progress is not None and progress > 0 else None
        if progress is None:
            measure = f"it did not finish in {elapsed_s:.1f} s"
        elif needed is None:
            measure = f"nothing of it moved in {elapsed_s:.1f} s"
        else:
            measure = (
                f"it moved {progress:.0%} of its bytes in {elapsed_s:.1f} s, so it needs about "
                f"{needed:.1f} s"
            )
        return cls(
            f"{what} needs more than refit_timeout_s={deadline_s:g} s ({measure}); every "
            "engine answered, none failed: raise refit_timeout_s",
            deadline_s=deadline_s,
            needed_s=needed,
            engines=engines,
        )


class RefitAbortedError(RefitError):
    """A communicator was aborted; it is unusable until rebuilt."""

    recovery = Recovery.RECOVER


class ChecksumMismatchError(RefitError, ValueError):
    """A payload's checksum did not match its contents; nothing was applied."""

    recovery = Recovery.RETRY


class StaleBaseError(RefitError):
    """A payload was built against another base version than the receiver holds."""

    recovery = Recovery.RESYNC


class VerificationError(RefitError):
    """Applied weights differ from what the trainer sent (digest or sampled values)."""

    recovery = Recovery.RESYNC


class GeometryMismatchError(RefitError, ValueError):
    """Sender and receiver disagree on the transfer plan (names, dtypes, shapes, buckets)."""


class InvalidTimeoutError(RefitError, ValueError):
    """A timeout given to refit is not None or a positive finite number of seconds."""


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

    recovery = Recovery.RECOVER

    def __init__(
        self,
        message: str,
        *,
        worker: str,
        operation: str,
        is_retryable: bool | None = None,
        recovery: Recovery | None = None,
        wedged_workers: Sequence[str] = (),
        engines: Sequence[EngineReport] = (),
    ) -> None:
        """The message reads ``"{worker}: {operation}: {message}"``; a ``message`` that
        already starts with the worker (and the operation), such as another WorkerError's
        text, is not prefixed again."""
        for prefix in (f"{worker}: ", f"{operation}: "):
            message = message.removeprefix(prefix)
        super().__init__(
            f"{worker}: {operation}: {message}",
            is_retryable=is_retryable,
            recovery=recovery,
            wedged_workers=wedged_workers,
            engines=engines,
        )
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


def refit_error_type(name: str) -> type[RefitError] | None:
    """The error class of this tree called ``name`` (for errors that travel by name, as
    across an engine's RPC), or None."""
    found = globals().get(name) if name in __all__ else None
    return found if isinstance(found, type) and issubclass(found, RefitError) else None


def with_engines(error: RefitError, reports: Sequence[EngineReport]) -> RefitError:
    """``error``, saying what each of ``reports``' engines serves now: added to ``engines``,
    named in the message, and a closed engine making ``recover()`` (a complete refit) needed
    where a plain retry was enough. A report of an engine (shard and label) ``error``
    already names replaces the one it has; one equal to it changes nothing, so applying the
    same reports twice adds them once."""
    known = {(e.shard, e.worker): e for e in error.engines}
    fresh = [r for r in reports if known.get((r.shard, r.worker)) != r]
    notes = []
    for report in fresh:
        if report.state is EngineState.CLOSED:
            notes.append(
                f"{report.worker} is closed: it holds every request until a complete refit"
            )
        elif report.state is EngineState.OLD:
            notes.append(f"{report.worker} serves version {report.version} as before")
        elif report.state is EngineState.UNKNOWN:
            notes.append(f"{report.worker} did not answer")
    if notes:
        error.args = (f"{error}; {'; '.join(notes)}",)
    known.update({(r.shard, r.worker): r for r in fresh})
    error.engines = tuple(known.values())
    if any(r.state is EngineState.CLOSED for r in reports) and error.recovery is Recovery.RETRY:
        error.recovery = Recovery.RECOVER
    return error
