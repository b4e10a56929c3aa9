"""What a relay decides when nobody decides for it.

Runs on the relay's event loop, on every turn and before every message is handled. A relay
aborts an open transfer it has not prepared once the transfer's deadline passed, or once
nothing happened to it for the relay's ``timeout_s`` (no coordinator can have committed it:
this relay never answered a FLUSH complete). A prepared transfer it never aborts alone: once
its decision is overdue (deadline passed, or ``timeout_s`` since it prepared) it asks every
other relay of its tree what became of it (OUTCOME), commits if one committed it, aborts if
one aborted it, and asks again later otherwise. A rollback its receiver failed is retried
until it succeeds.
"""

from __future__ import annotations

import logging

from refit_core import ProtocolError
from refit_zmq.relay.node.intake import PayloadIntake
from refit_zmq.relay.node.ledger import Ledger, TransferRecord
from refit_zmq.relay.node.peers import PeerRequests
from refit_zmq.relay.node.topology import Topology
from refit_zmq.relay.node.transactions import TransferControl
from refit_zmq.relay.wire.control import Reply
from refit_zmq.relay.wire.frames import Kind
from refit_zmq.relay.wire.reports import Failure, OutcomeReply, TransferState

__all__ = ["Unattended"]

logger = logging.getLogger(__name__)

_MIN_ASK_S = 0.5


def _ignore(_: object) -> None:
    """The continuation of a decision nobody asked for."""


class Unattended:
    """Ends the transfers nobody ended (see the module docstring).

    Args:
        timeout_s: the relay's timeout: an open transfer idle this long is aborted, a
            prepared one without a decision this long makes the relay ask its peers (and
            again every quarter of it, at least every 0.5 s).
    """

    def __init__(
        self,
        *,
        ledger: Ledger,
        intake: PayloadIntake,
        control: TransferControl,
        topology: Topology,
        peers: PeerRequests,
        timeout_s: float,
    ) -> None:
        self._ledger = ledger
        self._intake = intake
        self._control = control
        self._topology = topology
        self._peers = peers
        self._timeout_s = timeout_s
        self._ask_every_s = max(_MIN_ASK_S, timeout_s / 4)
        self._asking = False
        self._next_ask = 0.0

    def expire(self, now: float) -> None:
        """End what nobody ended."""
        record = self._ledger.current
        if record is not None and record.state is TransferState.OPEN:
            transfer_id = record.transfer_id
            idle = now - record.active_at > self._timeout_s
            busy = self._intake.in_flight(transfer_id) or self._control.flushing(transfer_id)
            if record.overdue(now) or (idle and not busy):
                self._abort_alone(record, now)
        elif record is not None and record.state is TransferState.PREPARED:
            overdue = record.overdue(now) or now - record.active_at > self._timeout_s
            if overdue and not self._asking and now >= self._next_ask:
                self._ask_peers(record.transfer_id, now)
        for transfer_id, retry_at in list(self._control.unrolled.items()):
            if now >= retry_at:
                self._control.abort(transfer_id, _ignore, self._ask_every_s)

    def _abort_alone(self, record: TransferRecord, now: float) -> None:
        if record.overdue(now):
            why = "its deadline passed"
        else:
            why = f"nothing happened to it for {self._timeout_s:.1f} s"
        logger.warning(
            "relay %s: transfer %s not prepared and %s; aborting it here",
            self._topology.own,
            record.transfer_id,
            why,
        )
        failure = Failure(self._topology.own, "DEADLINE", f"aborted by the relay: {why}")
        record.fail(failure, local=True)
        self._control.abort(record.transfer_id, _ignore, self._ask_every_s)

    def _ask_peers(self, transfer_id: str, now: float) -> None:
        tree = self._topology.tree
        peers = [] if tree is None else [a for a in tree.relays if a != self._topology.own]
        self._next_ask = now + self._ask_every_s
        if not peers:
            return
        self._asking = True
        logger.info(
            "relay %s: no decision on prepared transfer %s; asking %d peers",
            self._topology.own,
            transfer_id,
            len(peers),
        )
        requests = {peer: (Kind.OUTCOME, {"transfer_id": transfer_id}) for peer in peers}

        def heard(replies: dict[str, Reply]) -> None:
            self._asking = False
            states = set()
            for reply in replies.values():
                if isinstance(reply, dict):
                    try:
                        states.add(OutcomeReply.from_json(reply).state)
                    except ProtocolError:
                        continue
            record = self._ledger.current
            if record is None or record.transfer_id != transfer_id:
                return
            if record.state is not TransferState.PREPARED:
                return
            if TransferState.COMMITTED in states:
                logger.warning(
                    "relay %s: a peer committed %s; committing", self._topology.own, transfer_id
                )
                self._control.commit(transfer_id, _ignore)
            elif TransferState.ABORTED in states:
                logger.warning(
                    "relay %s: a peer aborted %s; aborting", self._topology.own, transfer_id
                )
                self._control.abort(transfer_id, _ignore, self._ask_every_s)

        within_s = min(self._timeout_s, self._ask_every_s)
        self._peers.send(requests, within_s=within_s, then=heard)
