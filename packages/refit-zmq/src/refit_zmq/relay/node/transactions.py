"""A relay's side of the two phases: FLUSH (prepared?), then COMMIT or ABORT; STATUS and
OUTCOME.

Runs on the relay's event loop; receiver calls go through the receiver thread, and their
answers are sent when they return. What a relay decides when nobody decides for it is in
:mod:`~refit_zmq.relay.node.unattended`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from refit_zmq.relay.apply.receiver import Receiver
from refit_zmq.relay.node.intake import PayloadIntake
from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.node.ledger import Ledger, TransferRecord
from refit_zmq.relay.node.peers import PeerRequests
from refit_zmq.relay.node.replies import Replies
from refit_zmq.relay.node.staging import Staging
from refit_zmq.relay.node.subtree import SubtreeFlush
from refit_zmq.relay.node.topology import Topology
from refit_zmq.relay.wire.errors import StaleTransferError, TransferConflictError, code_for_error
from refit_zmq.relay.wire.frames import Message
from refit_zmq.relay.wire.reports import (
    AbortReply,
    CommitReply,
    Failure,
    FlushReport,
    OutcomeReply,
    ReceiverStatus,
    RelayStatus,
    SubtreeReport,
    TransferState,
)

__all__ = ["Respond", "TransferControl"]

logger = logging.getLogger(__name__)

Respond = Callable[[FlushReport], None]
"""Gets a settled flush report."""


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
    """Answers FLUSH once a transfer is settled here, runs COMMIT, ABORT, STATUS and OUTCOME.

    Attributes:
        unrolled: transfer id -> when to retry its rollback (the receiver failed it).
    """

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
        peers: PeerRequests,
    ) -> None:
        self._receiver = receiver
        self._jobs = jobs
        self._ledger = ledger
        self._staging = staging
        self._intake = intake
        self._topology = topology
        self._replies = replies
        self._subtree = SubtreeFlush(peers)
        self._flushes: list[_FlushWaiter] = []
        self.unrolled: dict[str, float] = {}

    # -- flush ---------------------------------------------------------------------------

    def flush(
        self, transfer_id: str, expected: int, wait_s: float, digests: bool, respond: Respond
    ) -> None:
        """Call ``respond(report)`` once the transfer is settled here, or after ``wait_s``
        (or at the transfer's deadline, if that comes first)."""
        now = time.monotonic()
        record = self._ledger.record(transfer_id)
        if record is not None and record.live:
            record.touch(now)
        self._flushes.append(_FlushWaiter(transfer_id, expected, now + wait_s, digests, respond))
        self.check_flushes()

    def flushing(self, transfer_id: str) -> bool:
        """Whether a FLUSH of the transfer is waiting here."""
        return any(waiter.transfer_id == transfer_id for waiter in self._flushes)

    def on_flush(self, identity: bytes, message: Message) -> None:
        """FLUSH: answer DONE with the report (with ``subtree``: every subtree relay's)."""
        request_id = message.text("request_id")
        wait_s = message.seconds("wait_s")

        def respond(report: FlushReport | SubtreeReport) -> None:
            self._replies.done(identity, request_id, report.to_json())

        self.flush(
            message.text("transfer_id"),
            message.number("expected_payloads"),
            wait_s,
            message.flag("digests"),
            self.with_subtree(wait_s, respond) if message.flag("subtree") else respond,
        )

    def with_subtree(self, wait_s: float, respond: Callable[[SubtreeReport], None]) -> Respond:
        """A responder that first gathers the subtree's reports around this relay's own, the
        whole answer within ``wait_s`` from now."""
        deadline = time.monotonic() + wait_s
        return lambda report: self._subtree.gather(self._topology.own, report, deadline, respond)

    def _settled(self, waiter: _FlushWaiter) -> bool:
        record = self._ledger.record(waiter.transfer_id)
        if record is None:
            return waiter.expected == 0
        if not record.live:
            return True
        settled = len(record.results) + len(record.failed)
        return settled >= waiter.expected and not self._intake.in_flight(waiter.transfer_id)

    def check_flushes(self) -> None:
        """Answer every flush whose transfer settled or whose wait ran out."""
        now = time.monotonic()
        for waiter in list(self._flushes):
            record = self._ledger.record(waiter.transfer_id)
            due = waiter.deadline
            if record is not None and record.deadline is not None:
                due = min(due, record.deadline)
            settled = self._settled(waiter)
            if not settled and now < due:
                continue
            self._flushes.remove(waiter)
            report = self._report(waiter, record, settled, now)
            if waiter.digests:
                self._with_digests(report, waiter.respond)
            else:
                waiter.respond(report)

    def _with_digests(self, report: FlushReport, respond: Respond) -> None:
        receiver = self._receiver

        def answer(future: Future[ReceiverStatus]) -> None:
            held = None if future.exception() is not None else future.result().digests
            respond(dataclasses.replace(report, digests=held))

        self._jobs.submit(lambda: receiver.status(digests=True), answer)

    def _report(
        self, waiter: _FlushWaiter, record: TransferRecord | None, settled: bool, now: float
    ) -> FlushReport:
        own = self._topology.own
        version = self._ledger.version
        if record is None:
            record = TransferRecord(waiter.transfer_id, None, state=TransferState.UNKNOWN)
            record.started_at = now
        extra: list[Failure] = []
        if not settled:
            extra.append(
                Failure(
                    own,
                    "TIMEOUT",
                    f"{len(record.results)} of {waiter.expected} payloads applied when the "
                    "flush ran out of time (a dead or frozen parent or child?)",
                )
            )
        elif record.state is TransferState.ABORTED and not record.failures:
            extra.append(Failure(own, "STALE_TRANSFER", "the transfer was aborted here"))
        report = record.report(
            own, complete=False, expected=waiter.expected, version=version, now=now
        )
        failures = (*report.failures, *extra)
        complete = settled and not failures and record.state is not TransferState.ABORTED
        if complete and record.state is TransferState.OPEN:
            record.state = TransferState.PREPARED
            record.touch(now)
        return dataclasses.replace(report, complete=complete, failures=failures, state=record.state)

    # -- decisions -----------------------------------------------------------------------

    def _answer(self, identity: bytes, message: Message) -> Callable[[Future[object]], None]:
        """A continuation that answers NACK with a failed job's error."""
        request_id = message.text("request_id")

        def answer(future: Future[object]) -> None:
            error = future.exception()
            if error is not None:
                ids = _request_ids(message)
                self._replies.nack(identity, code_for_error(error), str(error), ids)
                return
            result = future.result()
            assert hasattr(result, "to_json")
            self._replies.done(identity, request_id, result.to_json())

        return answer

    def on_commit(self, identity: bytes, message: Message) -> None:
        """COMMIT: the receiver keeps the transfer's bits and adopts its version; only for a
        transfer this relay prepared (answered a FLUSH complete)."""
        transfer_id = message.text("transfer_id")
        record = self._ledger.record(transfer_id)
        if record is not None and record.state is TransferState.ABORTED:
            raise StaleTransferError(f"transfer {transfer_id} was aborted; it cannot commit")
        if record is not None and record.state is TransferState.OPEN:
            raise TransferConflictError(
                f"transfer {transfer_id} is not prepared here (no FLUSH answered complete)"
            )
        self.commit(transfer_id, self._answer(identity, message))

    def commit(self, transfer_id: str, then: Callable[[Future[object]], None]) -> None:
        """Commit the transfer here; ``then`` gets the :class:`CommitReply` (or the error)."""
        receiver = self._receiver

        def committed(future: Future[object]) -> None:
            if future.exception() is None:
                reply = future.result()
                assert isinstance(reply, CommitReply)
                self._ledger.finish(transfer_id, TransferState.COMMITTED, reply.version)
            then(future)

        self._jobs.submit(lambda: receiver.commit(transfer_id), committed)

    def on_abort(self, identity: bytes, message: Message) -> None:
        """ABORT: drop the transfer's payloads and roll the receiver back."""
        transfer_id = message.text("transfer_id")
        record = self._ledger.record(transfer_id)
        if record is not None and record.state is TransferState.COMMITTED:
            raise StaleTransferError(f"transfer {transfer_id} is committed; it cannot abort")
        self.abort(transfer_id, self._answer(identity, message))

    def abort(
        self, transfer_id: str, then: Callable[[Future[object]], None], retry_s: float = 1.0
    ) -> None:
        """Drop everything of the transfer, finish it as aborted, roll the receiver back (a
        failed rollback is listed in :attr:`unrolled`, due ``retry_s`` later); ``then`` gets
        the :class:`AbortReply` (or the error)."""
        was_live = self._ledger.finish(transfer_id, TransferState.ABORTED, self._ledger.version)
        self._intake.drop(transfer_id)
        receiver = self._receiver
        self.unrolled.pop(transfer_id, None)

        def rolled_back(future: Future[object]) -> None:
            error = future.exception()
            if error is not None:
                logger.warning(
                    "relay %s: rollback of %s failed: %s", self._topology.own, transfer_id, error
                )
                self.unrolled[transfer_id] = time.monotonic() + retry_s
                then(future)
                return
            reply = future.result()
            assert isinstance(reply, AbortReply)
            answered: Future[object] = Future()
            answered.set_result(dataclasses.replace(reply, aborted=was_live))
            then(answered)

        self._jobs.submit(lambda: receiver.rollback(transfer_id), rolled_back)
        self.check_flushes()

    def on_status(self, identity: bytes, message: Message) -> None:
        """STATUS: the receiver's version and open transfer, the ledger's, the staging."""
        request_id = message.text("request_id")

        def answer(status: RelayStatus | BaseException) -> None:
            if isinstance(status, RelayStatus):
                self._replies.done(identity, request_id, status.to_json())
            else:
                ids = _request_ids(message)
                self._replies.nack(identity, code_for_error(status), str(status), ids)

        self.status(message.flag("digests"), answer)

    def status(self, digests: bool, respond: Callable[[RelayStatus | BaseException], None]) -> None:
        """Read the receiver's status and the ledger's together; ``respond`` on the loop."""
        receiver = self._receiver

        def with_relay(future: Future[ReceiverStatus]) -> None:
            error = future.exception()
            if error is not None:
                respond(error)
                return
            held = future.result()
            current = self._ledger.current
            respond(
                RelayStatus(
                    relay=self._topology.own,
                    version=held.version,
                    open=held.open,
                    transfer=None if current is None else current.summary(time.monotonic()),
                    tree=self._topology.tree_id,
                    staged_bytes=self._staging.reserved_bytes,
                    peak_staged_bytes=self._staging.peak_bytes,
                    digests=held.digests,
                    began=held.began,
                )
            )

        self._jobs.submit(lambda: receiver.status(digests=digests), with_relay)

    def on_outcome(self, identity: bytes, message: Message) -> None:
        """OUTCOME: what became of a transfer here, from the ledger."""
        transfer_id = message.text("transfer_id")
        reply = OutcomeReply(transfer_id, self._ledger.state(transfer_id))
        self._replies.done(identity, message.text("request_id"), reply.to_json())
