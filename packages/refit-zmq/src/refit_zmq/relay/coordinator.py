"""The coordinator: configures the tree and ends every transfer in commit or abort, everywhere.

Two phases. Phase one is the producers' streaming followed by a FLUSH of every relay: each
answers once it has applied (and verified) every payload with its undo data kept, and its
children have acknowledged every payload it forwarded. The coordinator alone then decides:
commit only if every relay answered, complete, without a failure (and, if asked, with the
expected digests); otherwise abort. Phase two sends the decision to every relay. Decisions are
remembered, so a relay that missed one is finished by :meth:`RelayCoordinator.reconcile`
before the next transfer.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit_core import (
    ChecksumMismatchError,
    RefitError,
    RefitTimeoutError,
    StaleBaseError,
    VerificationError,
)
from refit_zmq.relay.auth import Signer
from refit_zmq.relay.control import ControlChannel, Reply
from refit_zmq.relay.curve import CurveConfig
from refit_zmq.relay.frames import Kind
from refit_zmq.relay.tree import RelayTree
from refit_zmq.relay.tuning import RelayTuning

__all__ = ["RelayCoordinator", "TransferOutcome", "new_transfer_id"]

logger = logging.getLogger(__name__)

_DECISIONS_KEPT = 256
_ERROR_BY_CODE: dict[str, type[RefitError]] = {
    "STALE_BASE": StaleBaseError,
    "UNREACHABLE": RefitTimeoutError,
    "TIMEOUT": RefitTimeoutError,
    "CHECKSUM": ChecksumMismatchError,
    "VERIFICATION": VerificationError,
    "DIGEST": VerificationError,
}


def new_transfer_id(target_version: int) -> str:
    """A fresh transfer id naming its target version."""
    return f"v{target_version}-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class TransferOutcome:
    """How a transfer ended.

    Attributes:
        transfer_id: the transfer.
        committed: the decision.
        reports: relay -> its flush report (relays that answered).
        failures: every failure: unreachable relays first, then what relays reported, then
            digest mismatches; each with ``relay``, ``code``, ``message`` (and payload ids).
        decision_errors: relay -> why it did not confirm the decision (in doubt until
            :meth:`RelayCoordinator.reconcile` reaches it).
    """

    transfer_id: str
    committed: bool
    reports: dict[str, dict[str, Any]]
    failures: list[dict[str, Any]]
    decision_errors: dict[str, str] = field(default_factory=dict)

    def error(self) -> RefitError:
        """The typed error of an aborted transfer, naming every failed relay."""
        codes = [f["code"] for f in self.failures]
        kind = next((_ERROR_BY_CODE[c] for c in codes if c in _ERROR_BY_CODE), RefitError)
        lines = [
            f"{f['relay']}"
            + (f" payload {f['payload_id']}" if "payload_id" in f else "")
            + f": {f['code']}: {f['message']}"
            for f in self.failures[:20]
        ]
        more = len(self.failures) - len(lines)
        text = f"transfer {self.transfer_id} aborted; " + "; ".join(lines)
        return kind(text + (f"; and {more} more" if more > 0 else ""))


class RelayCoordinator:
    """Configures relays and runs the two phases of each transfer.

    Args:
        api_key: the shared API key (None: relays run without one).
        timeout_s: how long one relay may take to answer one request.
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
        self.timeout_s = timeout_s
        self._tuning = tuning or RelayTuning()
        self._channel = ControlChannel(signer=Signer(api_key), curve=curve, tuning=self._tuning)
        self._tree: RelayTree | None = None
        self._decisions: OrderedDict[str, bool] = OrderedDict()

    @property
    def relays(self) -> tuple[str, ...]:
        """The relays of the configured tree."""
        return () if self._tree is None else self._tree.relays

    def _all(
        self, kind: Kind, fields: dict[str, Any], reply_within_s: float | None = None
    ) -> dict[str, Reply]:
        return self._channel.call(
            {address: (kind, fields) for address in self.relays},
            reply_within_s=self.timeout_s if reply_within_s is None else reply_within_s,
        )

    def configure_tree(self, relays: Sequence[str]) -> str:
        """Give every relay the tree over ``relays`` (in this order); return the tree id.

        Raises:
            RefitError: a relay refused or did not answer (named in the message).
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
            reply_within_s=self.timeout_s,
        )
        errors = {a: r for a, r in replies.items() if isinstance(r, RefitError)}
        if errors:
            raise RefitError(
                "configure_tree failed on " + "; ".join(f"{a}: {e}" for a, e in errors.items())
            )
        self._tree = tree
        logger.info("tree %s over %d relays (fanout %d)", tree.tree_id, len(relays), tree.fanout)
        return tree.tree_id

    def status(self, *, digests: bool = False) -> dict[str, Reply]:
        """Every relay's status: version, open transfer, staging (and digests)."""
        return self._all(Kind.STATUS, {"digests": digests})

    def reconcile(self) -> dict[str, Reply]:
        """Finish transfers a relay still holds open; return every relay's status afterwards.

        A transfer the coordinator committed is committed there (its bits are already
        applied, its undo still held); any other is rolled back (presumed abort).
        """
        statuses = self.status()
        finishing: dict[str, tuple[Kind, dict[str, Any]]] = {}
        for address, status in statuses.items():
            if isinstance(status, RefitError) or not status.get("open"):
                continue
            transfer_id = str(status["open"]["transfer_id"])
            commit = self._decisions.get(transfer_id, False)
            logger.warning(
                "relay %s still holds transfer %s open; finishing it (%s)",
                address,
                transfer_id,
                "commit" if commit else "abort",
            )
            finishing[address] = (
                Kind.COMMIT if commit else Kind.ABORT,
                {"transfer_id": transfer_id},
            )
        if finishing:
            self._channel.call(finishing, reply_within_s=self.timeout_s)
            statuses.update(
                self._channel.call(
                    {a: (Kind.STATUS, {}) for a in finishing}, reply_within_s=self.timeout_s
                )
            )
        return statuses

    def finish(
        self,
        transfer_id: str,
        expected_payloads: int,
        *,
        expected_digests: Mapping[str, int] | None = None,
        wait_s: float | None = None,
    ) -> TransferOutcome:
        """Flush every relay, decide, and deliver the decision.

        Args:
            transfer_id: the transfer the producers streamed.
            expected_payloads: how many payloads every relay must have applied.
            expected_digests: name -> ``tensor_digest`` every receiver must now hold.
            wait_s: how long a relay may wait for its payloads (default: ``timeout_s``).
        """
        wait = self.timeout_s if wait_s is None else wait_s
        replies = self._all(
            Kind.FLUSH,
            {
                "transfer_id": transfer_id,
                "expected_payloads": expected_payloads,
                "wait_s": wait,
                "digests": expected_digests is not None,
            },
            reply_within_s=wait + self.timeout_s,
        )
        reports = {a: r for a, r in replies.items() if not isinstance(r, RefitError)}
        failures = [
            {"relay": a, "code": "UNREACHABLE", "message": str(r)}
            for a, r in replies.items()
            if isinstance(r, RefitError)
        ]
        for report in reports.values():
            failures.extend(report.get("failures", []))
        if expected_digests is not None:
            failures.extend(_digest_mismatches(reports, expected_digests))
        committed = not failures and all(r.get("complete") for r in reports.values())
        decision_errors = self._decide(transfer_id, committed)
        return TransferOutcome(transfer_id, committed, reports, failures, decision_errors)

    def abort(self, transfer_id: str) -> dict[str, str]:
        """Decide abort without a flush (a producer failed); relay -> why it did not confirm."""
        return self._decide(transfer_id, False)

    def _decide(self, transfer_id: str, commit: bool) -> dict[str, str]:
        """Record the decision, then deliver it to every relay; the relays that did not confirm."""
        self._decisions[transfer_id] = commit
        while len(self._decisions) > _DECISIONS_KEPT:
            self._decisions.popitem(last=False)
        kind = Kind.COMMIT if commit else Kind.ABORT
        answers = self._all(kind, {"transfer_id": transfer_id})
        errors = {a: str(r) for a, r in answers.items() if isinstance(r, RefitError)}
        if errors:
            logger.warning("transfer %s: %s not confirmed by %s", transfer_id, kind, errors)
        logger.info("transfer %s %s", transfer_id, "committed" if commit else "aborted")
        return errors

    def close(self) -> None:
        """Close every socket."""
        self._channel.close()


def _digest_mismatches(
    reports: Mapping[str, dict[str, Any]], expected: Mapping[str, int]
) -> list[dict[str, Any]]:
    failures = []
    for address, report in reports.items():
        held = report.get("digests") or {}
        wrong = sorted(name for name, digest in expected.items() if held.get(name) != digest)
        if wrong:
            failures.append(
                {
                    "relay": address,
                    "code": "DIGEST",
                    "message": f"{len(wrong)} tensors differ from the trainer's: {wrong[:5]}",
                }
            )
    return failures
