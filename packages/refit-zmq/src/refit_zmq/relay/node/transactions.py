"""A relay's side of the two phases: FLUSH (prepared?), then COMMIT or ABORT, and STATUS.

Runs on the relay's event loop; receiver calls go through the receiver thread, and their
answers are sent when they return.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from refit_zmq.relay.apply.receiver import Receiver
from refit_zmq.relay.node.intake import PayloadIntake
from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.node.ledger import Ledger, TransferRecord
from refit_zmq.relay.node.replies import Replies
from refit_zmq.relay.node.staging import Staging
from refit_zmq.relay.node.subtree import Respond, SubtreeFlush
from refit_zmq.relay.node.topology import Topology
from refit_zmq.relay.wire.errors import StaleTransferError, TransferConflictError, code_for_error
from refit_zmq.relay.wire.frames import Message

__all__ = ["Respond", "TransferControl"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _FlushWaiter:
    transfer_id: str
    expected: int
    deadline: float
    digests: bool
    respond: Respond


def _request_ids(message: Message) -> dict[str, str]:
    names = ("transfer_id", "request_id")
    return {name: str(message.fields[name]) for name in names if name in message.fields}


class TransferControl:
    """Answers FLUSH once a transfer is settled here, and runs COMMIT, ABORT and STATUS."""

    def __init__(
        self,
        *,
        receiver: Receiver,
        jobs: ReceiverJobs,
        ledger: Ledger,
        staging: Staging,
        intake: PayloadIntake,
        topology: Topology,
        replies: Replies,
        subtree: SubtreeFlush,
    ) -> None:
        self._receiver = receiver
        self._jobs = jobs
        self._ledger = ledger
        self._staging = staging
        self._intake = intake
        self._topology = topology
        self._replies = replies
        self._subtree = subtree
        self._flushes: list[_FlushWaiter] = []

    # -- flush ---------------------------------------------------------------------------

    def flush(
        self, transfer_id: str, expected: int, wait_s: float, digests: bool, respond: Respond
    ) -> None:
        """Call ``respond(report)`` once the transfer is settled here, or after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        self._flushes.append(_FlushWaiter(transfer_id, expected, deadline, digests, respond))
        self.check_flushes()

    def on_flush(self, identity: bytes, message: Message) -> None:
        """FLUSH: answer DONE with the report (with ``subtree``: every subtree relay's)."""
        request_id = message.text("request_id")
        wait_s = message.seconds("wait_s")

        def respond(report: dict[str, Any]) -> None:
            self._replies.done(identity, request_id, report)

        self.flush(
            message.text("transfer_id"),
            message.number("expected_payloads"),
            wait_s,
            message.flag("digests"),
            self.with_subtree(wait_s, respond) if message.flag("subtree") else respond,
        )

    def with_subtree(self, wait_s: float, respond: Respond) -> Respond:
        """A responder that first gathers the subtree's reports around this relay's own, the
        whole answer within ``wait_s`` from now."""
        deadline = time.monotonic() + wait_s
        return lambda report: self._subtree.gather(self._topology.own, report, deadline, respond)

    def _settled(self, waiter: _FlushWaiter) -> bool:
        record = self._ledger.record(waiter.transfer_id)
        if record is None:
            return waiter.expected == 0
        if record.state != "open":
            return True
        settled = len(record.results) + len(record.failed)
        return settled >= waiter.expected and not self._intake.in_flight(waiter.transfer_id)

    def check_flushes(self) -> None:
        """Answer every flush whose transfer settled or whose wait ran out."""
        now = time.monotonic()
        for waiter in list(self._flushes):
            complete = self._settled(waiter)
            if not complete and now < waiter.deadline:
                continue
            self._flushes.remove(waiter)
            report = self._report(waiter, complete)
            if waiter.digests:
                self._with_digests(report, waiter.respond)
            else:
                waiter.respond(report)

    def _with_digests(self, report: dict[str, Any], respond: Respond) -> None:
        receiver = self._receiver

        def answer(future: Future[dict[str, Any]]) -> None:
            error = future.exception()
            digests = None if error is not None else future.result()["digests"]
            respond({**report, "digests": digests})

        self._jobs.submit(lambda: receiver.status(digests=True), answer)

    def _report(self, waiter: _FlushWaiter, complete: bool) -> dict[str, Any]:
        record = self._ledger.record(waiter.transfer_id)
        if record is None:
            record = TransferRecord(waiter.transfer_id, None, state="unknown")
        report = record.report(self._topology.own)
        report.update(complete=complete, expected=waiter.expected, version=self._ledger.version)
        if not complete:
            report["failures"].append(
                {
                    "relay": self._topology.own,
                    "code": "TIMEOUT",
                    "message": f"{report['applied']} of {waiter.expected} payloads applied "
                    "when the flush ran out of time (a dead or frozen parent or child?)",
                }
            )
        return report

    # -- decisions -----------------------------------------------------------------------

    def _answer(self, identity: bytes, message: Message) -> Callable[[Future[Any]], None]:
        """A continuation that answers DONE with the receiver's result, or NACK."""
        request_id = message.text("request_id")

        def answer(future: Future[dict[str, Any]]) -> None:
            error = future.exception()
            if error is not None:
                ids = _request_ids(message)
                self._replies.nack(identity, code_for_error(error), str(error), ids)
            else:
                self._replies.done(identity, request_id, future.result())

        return answer

    def on_commit(self, identity: bytes, message: Message) -> None:
        """COMMIT: the receiver keeps the transfer's bits and adopts its version."""
        transfer_id = message.text("transfer_id")
        record = self._ledger.record(transfer_id)
        if record is not None and record.state == "aborted":
            raise StaleTransferError(f"transfer {transfer_id} was aborted; it cannot commit")
        if (
            record is not None
            and record.state == "open"
            and (record.failures or self._intake.in_flight(transfer_id))
        ):
            raise TransferConflictError(
                f"transfer {transfer_id} is not prepared here (failures or payloads in flight)"
            )
        receiver = self._receiver
        answer = self._answer(identity, message)

        def committed(future: Future[dict[str, Any]]) -> None:
            if future.exception() is None:
                self._ledger.finish(transfer_id, "committed", future.result()["version"])
            answer(future)

        self._jobs.submit(lambda: receiver.commit(transfer_id), committed)

    def on_abort(self, identity: bytes, message: Message) -> None:
        """ABORT: drop the transfer's payloads and roll the receiver back."""
        transfer_id = message.text("transfer_id")
        record = self._ledger.record(transfer_id)
        if record is not None and record.state == "committed":
            raise StaleTransferError(f"transfer {transfer_id} is committed; it cannot abort")
        self._intake.drop(transfer_id)
        self._ledger.finish(transfer_id, "aborted", self._ledger.version)
        receiver = self._receiver
        self._jobs.submit(lambda: receiver.rollback(transfer_id), self._answer(identity, message))
        self.check_flushes()

    def on_status(self, identity: bytes, message: Message) -> None:
        """STATUS: the receiver's version and open transfer, the relay's staging."""
        receiver = self._receiver
        digests = message.flag("digests")
        current = self._ledger.current
        answer = self._answer(identity, message)

        def with_relay(future: Future[dict[str, Any]]) -> None:
            if future.exception() is None:
                future.result().update(
                    transfer=None if current is None else current.transfer_id,
                    tree=self._topology.tree_id,
                    staged_bytes=self._staging.reserved_bytes,
                    peak_staged_bytes=self._staging.peak_bytes,
                )
            answer(future)

        self._jobs.submit(lambda: receiver.status(digests=digests), with_relay)
