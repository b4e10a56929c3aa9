"""A group's calls under their deadlines: how each is issued, waited for, and how it fails.

The remaining deadline is the timeout of calls that take one (gloo); a watchdog aborts the
communicator where abort releases a blocked call (NCCL). A call that does not complete aborts
the group and raises :class:`~refit_core.RefitTimeoutError` (or
:class:`~refit_core.RefitAbortedError` when the group's owner aborted it first).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Literal, cast

from torch._C._distributed_c10d import ReduceOp

from refit_core import RefitAbortedError, RefitError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_nccl.group.lifecycle import GroupLifecycle
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import CallHandle, Communicator, RewaitableHandle
from refit_nccl.group.watchdog import Watchdog

__all__ = ["REDUCE_OPS", "DeadlineCalls", "PendingCall", "ReduceOpName", "first_line"]

logger = logging.getLogger(__name__)

ReduceOpName = Literal["sum", "max", "min"]

REDUCE_OPS: dict[ReduceOpName, ReduceOp.RedOpType] = {
    "sum": ReduceOp.SUM,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
}

_MIN_WAIT_S = 0.001
"""Work.wait treats a zero timeout as "no timeout"; never pass less than this."""

_ABORT_POLL_S = 0.05
"""How often a caller blocked in a gloo call checks whether its group was aborted."""

_DEADLINE_SLOP_S = 0.1
"""A call failing this close to its deadline is reported as a timeout (gloo's own timer
fires a hair before the deadline the timeout was derived from)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception (torch appends C++ stack traces)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class PendingCall:
    """An issued call; :meth:`wait` blocks until it completes or its deadline passes."""

    def __init__(
        self,
        calls: DeadlineCalls,
        what: str,
        work: CallHandle,
        deadline: Deadline,
        *,
        rewaitable: bool,
    ) -> None:
        self._calls = calls
        self._work: CallHandle | None = work
        self.what = what
        self.deadline = deadline
        self.rewaitable = rewaitable

    def wait(self) -> None:
        """Block until the call completes; idempotent.

        Raises:
            RefitTimeoutError: the call did not complete by its deadline, or a peer failed;
                the group is aborted.
            RefitAbortedError: the group was aborted by its owner while the call ran.
        """
        work, self._work = self._work, None
        if work is not None:
            self._calls.complete(self, work)


class DeadlineCalls:
    """Runs one group's calls under their deadlines.

    Args:
        spec: the group's spec (its label, and the timeout of disarmed calls).
        lifecycle: the group's lifecycle, aborted when a call does not complete.
    """

    def __init__(self, spec: GroupSpec, lifecycle: GroupLifecycle) -> None:
        self._spec = spec
        self._lifecycle = lifecycle

    def issue(
        self,
        what: str,
        deadline: Deadline,
        start: Callable[[Communicator, timedelta], CallHandle],
        *,
        rewaitable: bool = False,
    ) -> PendingCall:
        """Start a call; ``rewaitable``: its ``wait`` may time out and be waited on again
        (gloo's collectives; a timed-out wait of a gloo send or recv closes the pair)."""
        communicator = self._lifecycle.enter_call(what)
        try:
            timeout = self.timeout(deadline, what)
            with self.guard(deadline, what):
                work = start(communicator, timeout)
        except BaseException as exc:
            self._lifecycle.leave_call()
            raise self.failure(what, exc, deadline) from exc
        return PendingCall(self, what, work, deadline, rewaitable=rewaitable)

    def complete(self, call: PendingCall, work: CallHandle) -> None:
        """Wait for an issued call to complete (see :meth:`PendingCall.wait`)."""
        try:
            if self._lifecycle.known_traits.waits_in_slices and call.rewaitable:
                self._wait_in_slices(call, work)
            else:
                timeout = self.timeout(call.deadline, call.what)
                with self.guard(call.deadline, call.what):
                    work.wait(max(timeout, timedelta(seconds=_MIN_WAIT_S)))
        except BaseException as exc:
            raise self.failure(call.what, exc, call.deadline) from exc
        finally:
            self._lifecycle.leave_call()

    def timeout(self, deadline: Deadline, what: str) -> timedelta:
        """What is left of ``deadline`` (the disarmed timeout when it is disarmed).

        Raises:
            RefitTimeoutError: nothing is left.
        """
        remaining = deadline.remaining_s()
        if remaining is None:
            return timedelta(seconds=self._spec.disarmed_timeout_s)
        if remaining <= 0:
            raise RefitTimeoutError(f"{self._spec.label}: deadline passed before {what}")
        return timedelta(seconds=remaining)

    def guard(self, deadline: Deadline, what: str) -> contextlib.AbstractContextManager[object]:
        """A watchdog that aborts the group at ``deadline`` where that releases a blocked
        call (NCCL); nothing where it does not."""
        traits = self._lifecycle.traits
        if traits is None or not traits.abort_releases:
            return contextlib.nullcontext()
        cause = f"{what} passed its deadline"
        return Watchdog(
            deadline, lambda: self._lifecycle.abort(cause), what=f"{self._spec.label}: {what}"
        )

    def failure(self, what: str, exc: BaseException, deadline: Deadline) -> BaseException:
        """The error to raise for a call that did not complete; aborts the group."""
        label = self._spec.label
        if isinstance(exc, RefitError) or not isinstance(exc, Exception):
            self._lifecycle.abort(f"{what}: {exc!r}")
            return exc
        prior = self._lifecycle.abort_cause
        if prior is not None and not deadline.expired():
            return RefitAbortedError(
                f"{label}: {what} ended because the group was aborted: {prior}"
            )
        remaining = deadline.remaining_s()
        reason = (
            "passed its deadline"
            if remaining is not None and remaining <= _DEADLINE_SLOP_S
            else "failed (a peer was lost)"
        )
        cause = f"{label}: {what} {reason}: {first_line(exc)}"
        logger.warning("%s; aborting the group", cause)
        self._lifecycle.abort(cause)
        return RefitTimeoutError(f"{cause}; the group is aborted")

    def _wait_in_slices(self, call: PendingCall, work: CallHandle) -> None:
        """Wait for ``work``, leaving it (still running) as soon as the group is aborted.

        Raises:
            RefitAbortedError: the group was aborted while the call ran.
        """
        ends = time.monotonic() + self.timeout(call.deadline, call.what).total_seconds()
        while True:
            left_s = ends - time.monotonic()
            wait_s = min(left_s, _ABORT_POLL_S)
            try:
                work.wait(timedelta(seconds=max(wait_s, _MIN_WAIT_S)))
                return
            except RuntimeError:
                if wait_s >= left_s:  # the whole wait is spent
                    raise
                if cast(RewaitableHandle, work).is_completed():
                    # The call ended, possibly just as the slice timed out: its own outcome
                    # (success, or the group's error) decides, not the slice's timeout.
                    work.wait(timedelta(seconds=_MIN_WAIT_S))
                    return
            cause = self._lifecycle.abort_cause
            if cause is not None:
                raise RefitAbortedError(
                    f"{self._spec.label}: {call.what} abandoned: the group was aborted ({cause})"
                )
