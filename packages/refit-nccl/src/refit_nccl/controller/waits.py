"""How long the controller waits for its participants, and how a failed collective call ends
the group everywhere at once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from refit_core.backend import Deadline, Gathered, Participant, gather
from refit_nccl.controller.options import CollectiveOptions
from refit_nccl.group.spec import DISARMED_TIMEOUT_S
from refit_nccl.roles.contract import CollectiveMemberRole

__all__ = ["Waits", "abort_members", "time_left"]

logger = logging.getLogger(__name__)


def time_left(deadline: Deadline, what: str) -> float | None:
    """``deadline`` in its wire form (``Deadline.to_wire``: the seconds left, None when
    disarmed), for a call to a member that runs ``what``.

    Raises:
        RefitTimeoutError: nothing is left.
    """
    deadline.check(what)
    return deadline.to_wire()


def abort_members(
    name: str, members: Iterable[Participant[CollectiveMemberRole]], cause: str
) -> None:
    """Ask every member to abort group ``name``; never waits (a frozen one never answers)."""
    for participant in members:
        participant.call(CollectiveMemberRole.refit_abort, cause, name)


class Waits:
    """The controller's bounds on waiting for its participants (from its options)."""

    def __init__(self, options: CollectiveOptions) -> None:
        self._options = options

    def control_s(self, deadline: Deadline) -> float:
        """The bound of a non-collective call: the control timeout, or less when the deadline
        (plus grace) comes first."""
        remaining = deadline.remaining_s()
        limit = self._options.control_timeout_s
        return limit if remaining is None else min(limit, remaining + self._options.grace_s)

    def collective(
        self,
        calls: Mapping[Participant[Any], Future[Any]],
        deadline: Deadline,
        abort: Callable[[str], None],
    ) -> Gathered:
        """Wait for collective calls, up to deadline + grace. The first failure calls
        ``abort`` (which aborts the group on every member at once: a dead peer ends the refit
        everywhere, not at the deadline); the rest then get ``settle_s`` to report."""

        def abort_everyone(participant: Participant[Any], error: BaseException) -> None:
            logger.warning("collective call failed on %s; aborting the group", participant)
            abort(f"{participant.label} failed: {type(error).__name__}")

        remaining = deadline.remaining_s()
        settle = self._options.settle_s
        if remaining is None or deadline.at is None:
            return gather(
                calls,
                DISARMED_TIMEOUT_S + self._options.grace_s,
                settle_s=settle,
                on_failure=abort_everyone,
            )
        return gather(
            calls,
            remaining + self._options.grace_s,
            settle_at=deadline.at + settle,
            settle_s=settle,
            on_failure=abort_everyone,
        )
