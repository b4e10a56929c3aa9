"""A relay's payload path: admit (BEGIN), stage chunks (DATA), forward, apply, acknowledge.

Runs on the relay's event loop. A payload is admitted when it fits the staging budget,
forwarded to the children of its tree chunk by chunk as the chunks arrive, handed to the
receiver as they arrive too (:mod:`~refit_zmq.relay.node.local_apply`), acknowledged only after the
receiver finished it, and released once it is applied and streamed to every child.

A BEGIN that waits for room is answered QUEUED at once and again every half ``timeout_s``, so
its sender (which times out a silent relay) can tell a full relay from a dead one while, for
example, a frozen child of this relay holds the room until this relay gives the child up; a
BEGIN queued for ``QUEUE_TIMEOUTS`` times ``timeout_s`` is answered BUSY and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from refit_core import ProtocolError
from refit_core.backend import Deadline
from refit_zmq.relay.apply.receiver import Receiver
from refit_zmq.relay.node.forwarder import ChildLink, Forward
from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.node.ledger import Ledger
from refit_zmq.relay.node.local_apply import LocalApply
from refit_zmq.relay.node.replies import Replies, payload_ids
from refit_zmq.relay.node.staging import PayloadKey, Pending, StagedPayload, Staging
from refit_zmq.relay.node.topology import Topology
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.errors import (
    NackCode,
    StaleTransferError,
    TransferConflictError,
    code_for_error,
)
from refit_zmq.relay.wire.frames import QUEUE_TIMEOUTS, Kind, Message
from refit_zmq.relay.wire.link import LinkSettings
from refit_zmq.relay.wire.reports import ApplyResult, Failure, TransferState
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["PayloadIntake"]

logger = logging.getLogger(__name__)


class PayloadIntake:
    """Admits, stages, forwards and applies payloads; hears back from child links.

    Args:
        progress: called whenever a payload settles here or at a child (flushes re-check).
    """

    def __init__(
        self,
        *,
        context: zmq.Context[zmq.Socket[bytes]],
        receiver: Receiver,
        jobs: ReceiverJobs,
        ledger: Ledger,
        staging: Staging,
        topology: Topology,
        replies: Replies,
        signer: Signer,
        curve: CurveConfig | None,
        tuning: RelayTuning,
        timeout_s: float,
        progress: Callable[[], None],
    ) -> None:
        self._context = context
        self._local = LocalApply(receiver, jobs, self._applied)
        self._ledger = ledger
        self._staging = staging
        self._topology = topology
        self._replies = replies
        self._signer = signer
        self._settings = dataclasses.replace(LinkSettings.of(signer, curve, tuning), watched=False)
        self._tuning = tuning
        self._timeout_s = timeout_s
        self._progress = progress
        self.children: dict[str, ChildLink] = {}

    # -- requests ------------------------------------------------------------------------

    def on_begin(self, identity: bytes, message: Message) -> None:
        """Admit a payload, or queue it for room; answer a duplicate with its first ACK."""
        key = message.payload_key
        transfer_id, producer_id, payload_id = key
        root = message.optional_text("relay_root") or self._topology.own
        self._topology.check(root, message.optional_text("tree"))
        record = self._ledger.open(
            transfer_id,
            message.number("target"),
            Deadline.from_wire(message.fields["deadline_s"]),
            time.monotonic(),
        )
        checksum = message.text("checksum")
        known = record.checksums.get((producer_id, payload_id))
        if known is not None and known != checksum:
            raise TransferConflictError(
                f"payload {producer_id}/{payload_id} was sent with checksum {known}, now {checksum}"
            )
        result = record.results.get((producer_id, payload_id))
        if result is not None:
            record.duplicates += 1
            self._ack(identity, key, result, duplicate=True)
            return
        if known is None and record.state is TransferState.PREPARED:
            raise TransferConflictError(
                f"transfer {transfer_id} is prepared here; payload {producer_id}/{payload_id} "
                "comes after the FLUSH"
            )
        record.checksums[(producer_id, payload_id)] = checksum
        staged = self._staging.staged.get(key)
        if staged is not None:
            staged.route = identity
            self._ready(identity, key)
            return
        total = message.number("total_bytes")
        budget = self._staging.budget_bytes
        if total > budget:
            text = f"payload of {total} bytes exceeds max_inflight_bytes {budget}"
            self._replies.nack(identity, NackCode.TOO_LARGE, text, payload_ids(key))
            return
        forwarded = {
            "checksum": checksum,
            "verification_candidates": message.number("verification_candidates"),
            "base": message.optional_number("base"),
            "target": message.number("target"),
            "relay_root": root,
            "tree": self._topology.tree_id,
            "hops": message.number("hops", 0) + 1,
        }
        if not self._staging.wait(Pending(key, total, root, forwarded, identity)):
            text = "staging and admission queue are full"
            self._replies.nack(identity, NackCode.BUSY, text, payload_ids(key))
            return
        self.admit_waiting()
        if self._staging.queued(key):
            self._replies.payload(identity, Kind.QUEUED, key)

    def on_data(self, identity: bytes, message: Message) -> None:
        """Write a chunk in place, pass it on to the children, apply the payload once whole."""
        key = message.payload_key
        record = self._ledger.record(key[0])
        if record is not None and not record.live:
            raise StaleTransferError(f"transfer {key[0]} is already {record.state}")
        staged = self._staging.staged.get(key)
        if staged is None:
            if record is not None and key[1:] in record.results:
                return  # a late chunk of a retried payload that is already applied
            raise ProtocolError("chunk of a payload that was not admitted (BEGIN first)")
        if (
            message.text("checksum") != staged.checksum
            or message.number("total_bytes") != staged.total_bytes
        ):
            raise TransferConflictError("chunk does not belong to the admitted payload")
        staged.route = identity
        body = message.body
        assert body is not None
        try:
            if len(body) > self._tuning.chunk_bytes:
                raise ProtocolError(
                    f"chunk of {len(body)} bytes exceeds the chunk_bytes {self._tuning.chunk_bytes}"
                    " this relay announced in READY"
                )
            if not staged.write(message.number("offset"), body):
                return
        except ProtocolError as exc:
            self._refuse(staged, NackCode.MALFORMED, str(exc))
            return
        if record is not None:
            record.bytes_received += len(body)
            record.touch(staged.last_seen)
        for address in self._topology.children(staged.root):
            self.child(address).pump()
        self._local.pump()

    # -- staging -------------------------------------------------------------------------

    def admit_waiting(self) -> None:
        """Admit queued BEGINs that fit now: READY, then forward."""
        for pending in self._staging.admissible():
            staged = StagedPayload(
                pending.key,
                pending.fields["checksum"],
                pending.total_bytes,
                pending.root,
                pending.fields,
                pending.route,
            )
            self._staging.admit(staged)
            self._ready(staged.route, staged.key)
            record = self._ledger.record(staged.key[0])
            for address in self._topology.children(staged.root):
                if self.child(address).add(staged) and record is not None:
                    record.child(address).forwarded += 1
            self._local.add(staged)

    def _ready(self, identity: bytes, key: PayloadKey) -> None:
        """READY, with the largest chunk this relay accepts."""
        self._replies.payload(identity, Kind.READY, key, chunk_bytes=self._tuning.chunk_bytes)

    def child(self, address: str) -> ChildLink:
        """The link to a child relay (made on first use)."""
        child = self.children.get(address)
        if child is None:
            child = ChildLink(
                self._settings.open(self._context, address),
                signer=self._signer,
                events=self,
                timeout_s=self._timeout_s,
                tuning=self._tuning,
            )
            self.children[address] = child
        return child

    def _ack(
        self, identity: bytes, key: PayloadKey, result: ApplyResult, *, duplicate: bool
    ) -> None:
        self._replies.payload(identity, Kind.ACK, key, duplicate=duplicate, result=result.to_json())

    def _applied(self, staged: StagedPayload, future: Future[tuple[ApplyResult, float]]) -> None:
        staged.applied = True
        key = staged.key
        record = self._ledger.record(key[0])
        error = future.exception()
        if record is not None and record.live:
            record.settle(time.monotonic())
            if error is None:
                result, seconds = future.result()
                record.results[key[1:]] = result
                record.apply_s += seconds
                self._ack(staged.route, key, result, duplicate=False)
            else:
                code = code_for_error(error)
                logger.warning("relay %s: payload %s refused: %s", self._topology.own, key, error)
                record.fail(self._failure(code, str(error), key), local=True)
                self._replies.nack(staged.route, code, str(error), payload_ids(key))
        self._release_if_done(staged)
        self._progress()

    def _refuse(self, staged: StagedPayload, code: NackCode, text: str) -> None:
        """Fail a payload because of a chunk, undo it and tell its sender."""
        logger.warning("relay %s: payload %s refused: %s", self._topology.own, staged.key, text)
        self._fail_staged(staged, code, text, time.monotonic(), active=True)
        self._replies.nack(staged.route, code, text, payload_ids(staged.key))
        self.admit_waiting()

    def _fail_staged(
        self, staged: StagedPayload, code: str, text: str, now: float, *, active: bool
    ) -> None:
        """Record a staged payload's failure and let it go: children stop getting it, the
        receiver undoes what it wrote (``active``: the failure came with a message)."""
        key = staged.key
        record = self._ledger.record(key[0])
        if record is not None:
            record.fail(self._failure(code, text, key), local=True)
            record.settle(now, active=active)
        for child in self.children.values():
            child.drop(key.__eq__)
        staged.applied = True
        self._staging.release(staged)
        self._local.drop(staged)

    def _failure(
        self, code: str, message: str, key: PayloadKey, relay: str | None = None
    ) -> Failure:
        return Failure(relay or self._topology.own, code, message, key[1], key[2])

    def _release_if_done(self, staged: StagedPayload) -> None:
        if staged.done:
            self._staging.release(staged)
            self.admit_waiting()

    def in_flight(self, transfer_id: str) -> bool:
        """Whether a payload of the transfer is queued, staged, applying or being forwarded."""
        return (
            bool(self._staging.of_transfer(transfer_id))
            or any(p.key[0] == transfer_id for p in self._staging.pending)
            or any(child.busy(transfer_id) for child in self.children.values())
        )

    def drop(self, transfer_id: str) -> None:
        """Forget everything of an aborted transfer; queued senders are told."""
        for pending in self._staging.drop_pending(transfer_id):
            text = f"transfer {transfer_id} was aborted"
            self._replies.nack(
                pending.route, NackCode.STALE_TRANSFER, text, payload_ids(pending.key)
            )
        for child in list(self.children.values()):
            child.drop(lambda key: key[0] == transfer_id)
        for staged in self._staging.of_transfer(transfer_id):
            staged.applied = True
            self._staging.release(staged)
            self._local.drop(staged)
        self.admit_waiting()

    def expire(self, now: float) -> None:
        """Fail silent children; drop payloads whose sender went quiet; answer stale BEGINs BUSY."""
        for child in list(self.children.values()):
            child.expire(now)
        for pending in self._staging.pending:
            if now - pending.noticed >= self._timeout_s / 2:
                pending.noticed = now
                self._replies.payload(pending.route, Kind.QUEUED, pending.key)
        queue_s = QUEUE_TIMEOUTS * self._timeout_s
        stalled, expired = self._staging.idle(now, self._timeout_s, queue_s)
        for staged in stalled:
            text = (
                f"payload incomplete ({staged.received} of {staged.total_bytes} bytes) "
                f"after {self._timeout_s:.1f} s without a chunk"
            )
            self._fail_staged(staged, "TIMEOUT", text, now, active=False)
        for pending in expired:
            text = f"no room in staging within {queue_s:.1f} s"
            self._replies.nack(pending.route, NackCode.BUSY, text, payload_ids(pending.key))
        if stalled or expired:
            self.admit_waiting()

    def prune(self, relays: tuple[str, ...]) -> None:
        """Close the links to children that are no longer relays of the tree."""
        for address in [a for a in self.children if a not in relays]:
            self.children.pop(address).close()

    def close(self) -> None:
        """Close every child link."""
        for child in self.children.values():
            child.close()
        self.children.clear()

    # -- ForwardEvents -------------------------------------------------------------------

    def forwarded(self, child: str, forward: Forward, nbytes: int) -> None:
        """Count forwarded bytes."""
        record = self._ledger.record(forward.key[0])
        if record is not None:
            record.bytes_forwarded += nbytes

    def released(self, forward: Forward) -> None:
        """A child link is done with a payload's bytes."""
        forward.staged.forwards -= 1
        self._release_if_done(forward.staged)

    def acked(self, child: str, forward: Forward) -> None:
        """A child applied a payload."""
        record = self._ledger.record(forward.key[0])
        if record is not None:
            record.child(child).acked += 1
            record.touch(time.monotonic())
        self._progress()

    def failed(self, child: str, forward: Forward, code: str, message: str) -> None:
        """A child refused a payload or stopped answering."""
        record = self._ledger.record(forward.key[0])
        if record is not None and record.live:
            record.child(child).failed += 1
            record.fail(self._failure(code, message, forward.key, relay=child), local=False)
        self._progress()

    def deadline_s(self, transfer_id: str) -> float | None:
        """The transfer's deadline in its wire form (``Deadline.to_wire``), for the BEGIN a
        child gets."""
        record = self._ledger.record(transfer_id)
        return None if record is None else Deadline(record.deadline).to_wire()
