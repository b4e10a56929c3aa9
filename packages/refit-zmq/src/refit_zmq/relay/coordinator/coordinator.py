"""The coordinator: configures the tree and ends every transfer in commit or abort, everywhere.

Two phases. Phase one is the producers' streaming followed by a FLUSH of every relay: each
answers once it has applied (and verified) every payload with its undo data kept, and its
children have acknowledged every payload it forwarded; a complete answer *prepares* the
transfer there. The coordinator alone then decides: commit only if every relay answered,
complete, without a failure (and, if asked, with the expected digests); otherwise abort.
Phase two sends the decision to every relay. Decisions are remembered; a relay that missed
one is finished by :meth:`RelayCoordinator.close_open_transfers`, which reads both the ledger
and the receiver of every relay, and settles a transfer it has no record of by cooperative
termination (commit it if any relay committed it, else abort it).

Every request takes the caller's deadline (:class:`~refit_core.backend.Deadline`, required:
``Deadline.never()`` waits without one); one attempt waits ``timeout_s`` at most, and less
when the deadline is near (:func:`attempt_timeout_s`). With a deadline, the flush and the
delivery of the decision both end by it: relays are asked to answer the FLUSH by the deadline
(less :data:`FLUSH_MARGIN_S`), their answers are awaited until the deadline, and the decision
is delivered for at most :data:`DECISION_GRACE_S` past it, so an error reaches the caller by
the deadline plus less than a second. Relays that were not reached settle the transfer on
their own (see PROTOCOL.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from refit_core import ProtocolError, RefitError
from refit_core.backend import Deadline
from refit_zmq.relay.coordinator.outcome import TransferOutcome, relay_error
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.control import ControlChannel, Reply
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.frames import Kind
from refit_zmq.relay.wire.liveness import refuses_connections
from refit_zmq.relay.wire.reports import (
    AbortReply,
    CommitReply,
    Failure,
    FlushReport,
    OutcomeReply,
    RelayStatus,
    TransferState,
    TreeReply,
)
from refit_zmq.relay.wire.tree import RelayTree
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = [
    "DECISION_GRACE_S",
    "FLUSH_MARGIN_S",
    "MIN_ATTEMPT_S",
    "RelayCoordinator",
    "Statuses",
    "attempt_timeout_s",
    "new_transfer_id",
]

logger = logging.getLogger(__name__)

DECISION_GRACE_S = 0.4
"""How long past the deadline the coordinator keeps delivering a decision."""
FLUSH_MARGIN_S = 0.25
"""How long before the deadline relays are asked to answer a FLUSH (at most a tenth of what
is left), so their answers arrive by it."""

MIN_ATTEMPT_S = 0.05
"""The shortest wait of one attempt, however near the deadline."""

_DECISIONS_KEPT = 256

Statuses = dict[str, RelayStatus | RefitError]
"""Relay -> its status, or the error its STATUS request ended in."""


def new_transfer_id(target_version: int) -> str:
    """A fresh transfer id naming its target version (``v<target>-<16 hex>``)."""
    return f"v{target_version}-{uuid.uuid4().hex[:16]}"


def attempt_timeout_s(timeout_s: float, retries: int, deadline_left_s: float | None) -> float:
    """How long one attempt of a control request waits for its reply: ``timeout_s``, within
    what the deadline leaves (``deadline_left_s``; None: no deadline) for all ``retries + 1``
    attempts to take at most half of it, and at least :data:`MIN_ATTEMPT_S`."""
    if deadline_left_s is None:
        return timeout_s
    return max(MIN_ATTEMPT_S, min(timeout_s, deadline_left_s / (2 * (retries + 1))))


def _typed(reply: Reply, parse: Any) -> Any:
    """The typed reply, or the error the request or the parsing ended in."""
    if isinstance(reply, RefitError):
        return reply
    try:
        return parse(reply)
    except ProtocolError as exc:
        return exc


class RelayCoordinator:
    """Configures relays and runs the two phases of each transfer.

    Args:
        api_key: the shared API key (None: relays run without one).
        timeout_s: how long one relay may take to answer one request (STATUS, CONFIGURE,
            OUTCOME, COMMIT, ABORT; each retried ``tuning.retries`` times); a request's own
            deadline shortens it (:func:`attempt_timeout_s`). Fixed for the coordinator's
            life: every call takes its deadline as an argument instead.
        tuning: fan-out of the tree, retries and backoff.
        curve: the relays' CURVE public key, when they encrypt.
    """

    def __init__(
        self,
        *,
        api_key: str | None,
        timeout_s: float,
        tuning: RelayTuning | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._tuning = tuning or RelayTuning()
        self._channel = ControlChannel(signer=Signer(api_key), curve=curve, tuning=self._tuning)
        self._tree: RelayTree | None = None
        self._decisions: OrderedDict[str, bool] = OrderedDict()

    @property
    def timeout_s(self) -> float:
        """The longest wait of one attempt (read-only)."""
        return self._timeout_s

    @property
    def relays(self) -> tuple[str, ...]:
        """The relays of the configured tree."""
        return () if self._tree is None else self._tree.relays

    def _attempt_s(self, deadline: Deadline) -> float:
        """One attempt's wait under ``deadline`` (see :func:`attempt_timeout_s`)."""
        return attempt_timeout_s(self._timeout_s, self._tuning.retries, deadline.remaining_s())

    def gone(self) -> tuple[str, ...]:
        """The relays of the tree whose ports refuse connections (dead, or closed)."""
        return tuple(a for a in self.relays if refuses_connections(a))

    def configure_tree(
        self,
        relays: Sequence[str],
        *,
        deadline: Deadline,
        shards: Mapping[str, int] | None = None,
    ) -> str:
        """Give every relay the tree over ``relays`` (in this order); return the tree id.
        Links to relays no longer in the tree are closed.

        Args:
            relays: the tree's relays.
            deadline: no attempt runs past it.
            shards: relay address -> its shard index, for the error (default: list order).

        Raises:
            RefitError: a relay refused or did not answer (named, with every relay's state).
        """
        tree = RelayTree.of(relays, self._tuning.fanout)
        replies = self._channel.call(
            {
                address: (
                    Kind.CONFIGURE,
                    {"relays": list(relays), "own_address": address, "fanout": tree.fanout},
                )
                for address in relays
            },
            reply_within_s=self._attempt_s(deadline),
            until=deadline.at,
        )
        answers = {a: _typed(r, TreeReply.from_json) for a, r in replies.items()}
        errors = {a: r for a, r in answers.items() if isinstance(r, RefitError)}
        if errors:
            order = shards or {address: i for i, address in enumerate(relays)}
            raise relay_error("configuring the tree", errors, order, {})
        self._tree = tree
        self._channel.retain(tree.relays)
        logger.info("tree %s over %d relays (fanout %d)", tree.tree_id, len(relays), tree.fanout)
        return tree.tree_id

    def status(
        self,
        *,
        digests: bool = False,
        relays: Sequence[str] | None = None,
        deadline: Deadline,
        probe_s: float | None = None,
    ) -> Statuses:
        """Every relay's status (those of ``relays``, default the tree's): version, the
        receiver's and the ledger's open transfer, staging (and digests). Read-only: the
        relays need no tree for it. No attempt runs past ``deadline``.

        Args:
            probe_s: ask each relay once, waiting this long for its answer (a relay that did
                not answer the last request starts on a fresh socket); default: the usual
                attempts (:func:`attempt_timeout_s`).
        """
        addresses = self.relays if relays is None else tuple(relays)
        replies = self._channel.call(
            {a: (Kind.STATUS, {"digests": digests}) for a in addresses},
            until=deadline.at,
            reply_within_s=self._attempt_s(deadline) if probe_s is None else probe_s,
            retries=None if probe_s is None else 0,
        )
        return {a: _typed(r, RelayStatus.from_json) for a, r in replies.items()}

    def close_open_transfers(self, *, deadline: Deadline) -> Statuses:
        """Finish every transfer a relay still holds open, in its ledger or its receiver;
        return every relay's status afterwards.

        A transfer this coordinator decided gets its decision. Any other (a coordinator
        that died, a decision that was never recorded) is settled by cooperative
        termination: committed everywhere if any relay committed it, else aborted. Relays
        that do not answer keep what they hold and settle it on their own. No request runs
        past ``deadline``.
        """
        until = deadline.at
        statuses = self.status(deadline=deadline)
        holders: dict[str, set[str]] = {}
        for address, status in statuses.items():
            if isinstance(status, RelayStatus):
                for transfer_id in status.open_transfers:
                    holders.setdefault(transfer_id, set()).add(address)
        if not holders:
            return statuses
        finishing: dict[str, tuple[Kind, dict[str, Any]]] = {}
        for transfer_id, addresses in holders.items():
            commit = self._decisions.get(transfer_id)
            if commit is None:
                commit = self._committed_anywhere(transfer_id, deadline)
                self._record(transfer_id, commit)
            kind = Kind.COMMIT if commit else Kind.ABORT
            logger.warning(
                "relays %s still hold transfer %s open; finishing it (%s)",
                sorted(addresses),
                transfer_id,
                kind,
            )
            for address in addresses:
                finishing[address] = (kind, {"transfer_id": transfer_id})
        self._channel.call(finishing, reply_within_s=self._attempt_s(deadline), until=until)
        statuses.update(self.status(relays=list(finishing), deadline=deadline))
        return statuses

    reconcile = close_open_transfers

    def _committed_anywhere(self, transfer_id: str, deadline: Deadline) -> bool:
        """Whether any relay of the tree committed ``transfer_id`` (OUTCOME to all)."""
        replies = self._channel.call(
            {a: (Kind.OUTCOME, {"transfer_id": transfer_id}) for a in self.relays},
            reply_within_s=self._attempt_s(deadline),
            until=deadline.at,
        )
        return any(
            isinstance(r, OutcomeReply) and r.state is TransferState.COMMITTED
            for r in (_typed(reply, OutcomeReply.from_json) for reply in replies.values())
        )

    def finish(
        self,
        transfer_id: str,
        expected_payloads: int,
        *,
        expected_digests: Mapping[str, int] | None = None,
        deadline: Deadline,
    ) -> TransferOutcome:
        """Flush every relay (:meth:`flush`), decide, and deliver the decision."""
        flushed = self.flush(
            transfer_id, expected_payloads, expected_digests=expected_digests, deadline=deadline
        )
        decisions, errors = self.decide(transfer_id, flushed.committed, deadline=deadline)
        return dataclasses.replace(flushed, decisions=decisions, decision_errors=errors)

    def flush(
        self,
        transfer_id: str,
        expected_payloads: int,
        *,
        expected_digests: Mapping[str, int] | None = None,
        deadline: Deadline,
    ) -> TransferOutcome:
        """Phase one's end: FLUSH every relay and tell whether the transfer may commit
        (``committed``: every relay prepared it); nothing is decided or delivered yet.

        Args:
            transfer_id: the transfer the producers streamed.
            expected_payloads: how many payloads every relay must have applied.
            expected_digests: name -> ``tensor_digest`` every receiver must now hold.
            deadline: the refit's deadline: relays answer the FLUSH by it (disarmed: each
                relay may wait ``timeout_s`` for its payloads).
        """
        left = deadline.remaining_s()
        if left is None:
            wait_s, until = self._timeout_s, None
            reply_within_s = wait_s + self._timeout_s
        else:
            wait_s = max(0.0, left - min(FLUSH_MARGIN_S, left / 10))
            until = time.monotonic() + left
            reply_within_s = left
        replies = self._channel.call(
            {
                address: (
                    Kind.FLUSH,
                    {
                        "transfer_id": transfer_id,
                        "expected_payloads": expected_payloads,
                        "wait_s": wait_s,
                        "digests": expected_digests is not None,
                    },
                )
                for address in self.relays
            },
            reply_within_s=reply_within_s,
            until=until,
            stop_when_gone=True,  # one relay gone: the transfer aborts, wait for no other
        )
        answers = {a: _typed(r, FlushReport.from_json) for a, r in replies.items()}
        reports = {a: r for a, r in answers.items() if isinstance(r, FlushReport)}
        causes = {a: r for a, r in answers.items() if isinstance(r, RefitError)}
        failures = [Failure(a, "UNREACHABLE", str(r)) for a, r in causes.items()]
        for report in reports.values():
            failures.extend(report.failures)
        if expected_digests is not None:
            failures.extend(_digest_mismatches(reports, expected_digests))
        committed = (
            not failures
            and len(reports) == len(self.relays)
            and all(r.complete for r in reports.values())
        )
        return TransferOutcome(transfer_id, committed, reports, tuple(failures), causes=causes)

    def _record(self, transfer_id: str, commit: bool) -> None:
        self._decisions[transfer_id] = commit
        while len(self._decisions) > _DECISIONS_KEPT:
            self._decisions.popitem(last=False)

    def decide(
        self, transfer_id: str, commit: bool, *, deadline: Deadline
    ) -> tuple[dict[str, CommitReply | AbortReply], dict[str, RefitError]]:
        """Record the decision, then deliver it to every relay (for at most
        :data:`DECISION_GRACE_S` past the deadline, each attempt waiting at least that
        grace); every relay's confirmation, and the relays that did not confirm with why."""
        self._record(transfer_id, commit)
        kind = Kind.COMMIT if commit else Kind.ABORT
        until = None
        if deadline.at is not None:
            until = max(time.monotonic(), deadline.at) + DECISION_GRACE_S
        replies = self._channel.call(
            {a: (kind, {"transfer_id": transfer_id}) for a in self.relays},
            reply_within_s=max(self._attempt_s(deadline), DECISION_GRACE_S),
            until=until,
        )
        parse = CommitReply.from_json if commit else AbortReply.from_json
        answers = {a: _typed(r, parse) for a, r in replies.items()}
        errors = {a: r for a, r in answers.items() if isinstance(r, RefitError)}
        decisions = {a: r for a, r in answers.items() if not isinstance(r, RefitError)}
        if errors:
            logger.warning("transfer %s: %s not confirmed by %s", transfer_id, kind, sorted(errors))
        logger.info("transfer %s %s", transfer_id, "committed" if commit else "aborted")
        return decisions, errors

    def close(self) -> None:
        """Close every socket."""
        self._channel.close()


def _digest_mismatches(
    reports: Mapping[str, FlushReport], expected: Mapping[str, int]
) -> list[Failure]:
    failures = []
    for address, report in reports.items():
        held = report.digests or {}
        wrong = sorted(name for name, digest in expected.items() if held.get(name) != digest)
        if wrong:
            message = f"{len(wrong)} tensors differ from the trainer's: {wrong[:5]}"
            failures.append(Failure(address, "DIGEST", message))
    return failures
