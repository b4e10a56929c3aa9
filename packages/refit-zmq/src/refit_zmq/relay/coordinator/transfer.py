"""One whole transfer: every producer streams its shard at once, then the coordinator decides
(at once, or later for a staged refit: :func:`prepare_transfer`, :func:`decide_transfer`).

Producers are :class:`~refit_zmq.relay.producer.shard.ShardProducer` objects reached as
participants (Ray actors on the trainer ranks, or objects in this process). Their trackers
commit their baselines only after the coordinator committed the transfer on the relays; on
any failure they are aborted, so the next transfer is again a delta against the version
every receiver holds (or a dense resync when asked).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from refit_core import EngineState, RefitError, RefitTimeoutError, WorkerError
from refit_core.backend import Deadline, Participant, gather, method_name
from refit_zmq.relay.coordinator.coordinator import (
    DECISION_GRACE_S,
    RelayCoordinator,
    new_transfer_id,
)
from refit_zmq.relay.coordinator.outcome import TransferOutcome
from refit_zmq.relay.producer.shard import ShardProducerRole, StreamOrder, TransferOptions
from refit_zmq.relay.wire.errors import code_for_error
from refit_zmq.relay.wire.reports import Failure

__all__ = [
    "PreparedTransfer",
    "TransferResult",
    "decide_transfer",
    "prepare_transfer",
    "run_transfer",
]

logger = logging.getLogger(__name__)

_WATCH_S = 0.25
"""How often the relays' ports are checked while the producers stream."""


@dataclass(frozen=True)
class TransferResult:
    """A committed transfer: the coordinator's outcome, each producer's counts, the timings.

    ``unsettled`` names the producers that did not confirm their tracker's commit (their
    next transfer must be a dense resync).
    """

    outcome: TransferOutcome
    shards: list[dict[str, int]]
    stream_s: float
    finish_s: float
    unsettled: tuple[str, ...] = ()

    def total(self, key: str) -> int:
        """A count summed over the shards (``payloads``, ``wire_bytes``, ...)."""
        return sum(shard[key] for shard in self.shards)


@dataclass(frozen=True)
class PreparedTransfer:
    """A transfer every relay prepared (streamed, verified, undo kept), awaiting the decision
    (:func:`decide_transfer`); the producers' trackers still hold it as pending."""

    flushed: TransferOutcome
    shards: list[dict[str, int]]
    stream_s: float
    flush_s: float

    @property
    def transfer_id(self) -> str:
        """The transfer."""
        return self.flushed.transfer_id


def run_transfer(
    coordinator: RelayCoordinator,
    producers: Sequence[Participant[ShardProducerRole]],
    *,
    target_version: int,
    resync: bool,
    options: TransferOptions,
    expected_digests: Mapping[str, int] | None = None,
    deadline: Deadline,
    shards: Mapping[str, int] | None = None,
) -> TransferResult:
    """Both phases at once: :func:`prepare_transfer`, then commit (:func:`decide_transfer`)."""
    prepared = prepare_transfer(
        coordinator,
        producers,
        target_version=target_version,
        resync=resync,
        options=options,
        expected_digests=expected_digests,
        deadline=deadline,
        shards=shards,
    )
    return decide_transfer(
        coordinator, producers, prepared, commit=True, options=options, deadline=deadline
    )


def prepare_transfer(
    coordinator: RelayCoordinator,
    producers: Sequence[Participant[ShardProducerRole]],
    *,
    target_version: int,
    resync: bool,
    options: TransferOptions,
    expected_digests: Mapping[str, int] | None = None,
    deadline: Deadline,
    shards: Mapping[str, int] | None = None,
) -> PreparedTransfer:
    """Let every producer stream (concurrently, each rooted at its own relay) and flush
    every relay: phase one, which leaves every relay's receiver on its version.

    Args:
        deadline: the refit's deadline: it travels with every payload (a relay aborts a
            transfer it has not prepared by then), and bounds the producers' streams (a
            producer still streaming then is named as wedged) and the flush (see
            :meth:`RelayCoordinator.flush`).
        shards: relay address -> its shard index, for the error (default: tree order).

    Raises:
        RefitError: a producer or a relay failed; the transfer was aborted everywhere, every
            tracker too, and the error names the relays or producers that failed, with every
            relay's state (:meth:`TransferOutcome.error`).
    """
    shards = shards or {address: i for i, address in enumerate(coordinator.relays)}
    transfer_id = new_transfer_id(target_version)
    order = StreamOrder(
        transfer_id, coordinator.relays, target_version, resync, options, deadline.to_wire()
    )
    started = time.monotonic()
    calls = {p: p.call(ShardProducerRole.refit_stream, order) for p in producers}
    gone = _watch(coordinator, transfer_id, calls.values(), deadline)
    remaining = deadline.remaining_s()
    streams = gather(calls, None if remaining is None else remaining + DECISION_GRACE_S)
    streamed = time.monotonic()
    if gone or not streams.ok:
        logger.warning("transfer %s: a relay or a producer failed; aborting", transfer_id)
        decisions, errors = coordinator.decide(transfer_id, False, deadline=deadline)
        answered = [p for p in producers if p not in streams.missing]
        _settle(answered, commit=False, wait_s=_settle_s(options, deadline))
        failures = (*_gone(gone), *_refusals(streams.errors.values()))
        aborted = TransferOutcome(transfer_id, False, {}, failures, decisions, errors)
        if gone:
            raise aborted.error(shards, target=target_version)
        missing = [p.label for p in streams.missing]
        error = _producer_error(streams.errors, missing, aborted, shards)
        if isinstance(error, RefitTimeoutError) and not streams.missing:
            error.progress = _progress(streams.errors.values())
        raise error
    stats = [streams.results[p] for p in producers]
    flushed = coordinator.flush(
        transfer_id,
        sum(s["payloads"] for s in stats),
        expected_digests=expected_digests,
        deadline=deadline,
    )
    if not flushed.committed:
        decisions, errors = coordinator.decide(transfer_id, False, deadline=deadline)
        _settle(producers, commit=False, wait_s=_settle_s(options, deadline))
        aborted = dataclasses.replace(flushed, decisions=decisions, decision_errors=errors)
        raise aborted.error(shards, target=target_version)
    return PreparedTransfer(flushed, stats, streamed - started, time.monotonic() - streamed)


def decide_transfer(
    coordinator: RelayCoordinator,
    producers: Sequence[Participant[ShardProducerRole]],
    prepared: PreparedTransfer,
    *,
    commit: bool,
    options: TransferOptions,
    deadline: Deadline,
) -> TransferResult:
    """Phase two: deliver the decision on ``prepared`` to every relay, then commit or abort
    the producers' trackers. Relays that did not confirm are in the outcome's
    ``decision_errors`` (they settle the transfer with their peers, or the next
    :meth:`RelayCoordinator.close_open_transfers` finishes it)."""
    started = time.monotonic()
    decisions, errors = coordinator.decide(prepared.transfer_id, commit, deadline=deadline)
    unsettled = _settle(producers, commit=commit, wait_s=_settle_s(options, deadline))
    outcome = dataclasses.replace(
        prepared.flushed, committed=commit, decisions=decisions, decision_errors=errors
    )
    finish_s = prepared.flush_s + time.monotonic() - started
    return TransferResult(outcome, prepared.shards, prepared.stream_s, finish_s, unsettled)


def _watch(
    coordinator: RelayCoordinator,
    transfer_id: str,
    streams: Iterable[Future[Any]],
    deadline: Deadline,
) -> tuple[str, ...]:
    """Wait for the producers' streams, checking that every relay of the tree still listens;
    the relays found gone (the transfer is then aborted at once, so the streams end early
    instead of at the deadline), or none."""
    pending = set(streams)
    while pending and not deadline.expired():
        left = deadline.remaining_s()
        done, pending = concurrent.futures.wait(
            pending,
            timeout=_WATCH_S if left is None else min(_WATCH_S, left),
            return_when=concurrent.futures.FIRST_EXCEPTION,
        )
        if any(future.exception() is not None for future in done):
            return ()
        gone = coordinator.gone() if pending else ()
        if gone:
            logger.warning("transfer %s: relays %s are gone; aborting", transfer_id, list(gone))
            coordinator.decide(transfer_id, False, deadline=deadline)
            return gone
    return ()


def _gone(relays: Iterable[str]) -> tuple[Failure, ...]:
    return tuple(
        Failure(a, "UNREACHABLE", "its port refuses connections: the relay is gone") for a in relays
    )


def _refusals(errors: Iterable[BaseException]) -> tuple[Failure, ...]:
    """The relays that refused a producer's payload, as failure records (their engines)."""
    return tuple(
        Failure(report.worker, code_for_error(error), report.reason)
        for error in errors
        if isinstance(error, RefitError)
        for report in error.engines
        if report.reason is not None
    )


def _progress(errors: Iterable[BaseException]) -> float | None:
    """The share of the transfer that moved: the least of the producers' (None: one of
    them cannot say)."""
    shares = [error.progress if isinstance(error, RefitError) else None for error in errors]
    known = [share for share in shares if share is not None]
    return min(known) if known and len(known) == len(shares) else None


def _settle_s(options: TransferOptions, deadline: Deadline) -> float:
    """How long producers may take to settle their trackers: one reply's timeout, and never
    past the decision's grace after the deadline."""
    left = deadline.remaining_s()
    return options.timeout_s if left is None else min(options.timeout_s, left + DECISION_GRACE_S)


def _settle(
    producers: Sequence[Participant[ShardProducerRole]], *, commit: bool, wait_s: float | None
) -> tuple[str, ...]:
    """Commit or abort the producers' trackers; the labels of those that did not confirm.

    A producer still streaming when the transfer failed is not told: its stream fails on the
    aborted transfer and aborts its tracker itself (or its next stream drops the leftover)."""
    method = ShardProducerRole.refit_commit if commit else ShardProducerRole.refit_abort
    settled = gather({p: p.call(method) for p in producers}, wait_s)
    failed = (*settled.errors, *settled.missing)
    if failed:
        what = "commit" if commit else "abort"
        logger.warning("%s failed on producers %s", what, [p.label for p in failed])
    return tuple(p.label for p in failed)


def _producer_error(
    errors: Mapping[Participant[ShardProducerRole], BaseException],
    missing: Sequence[str],
    aborted: TransferOutcome,
    shards: Mapping[str, int],
) -> RefitError:
    """The error a failed stream raises: a timeout naming the producers still streaming at
    the deadline, else the first producer's failure (a relay's refusal it met, or a dead
    rank) named; with every relay's state after the abort, the producer's error as cause."""
    engines = aborted.engines(shards)
    unknown = [e.worker for e in engines if e.state is EngineState.UNKNOWN]
    if missing:
        return RefitTimeoutError(
            f"producers {list(missing)} still streaming at the refit's deadline; "
            f"transfer {aborted.transfer_id} aborted",
            engines=engines,
            wedged_workers=[*missing, *unknown],
        )
    participant, error = next(iter(errors.items()))
    lines = str(error).strip().splitlines()
    first_line = f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
    failed: RefitError
    if isinstance(error, RefitError) and not isinstance(error, WorkerError):
        failed = type(error)(
            f"{participant.label} could not stream transfer {aborted.transfer_id}: {first_line}",
            recovery=error.recovery,
            engines=engines,
            wedged_workers=unknown,
        )
    else:
        failed = WorkerError(
            first_line,
            worker=participant.label,
            operation=(
                f"{method_name(ShardProducerRole.refit_stream)} "
                f"(transfer {aborted.transfer_id} aborted)"
            ),
            engines=engines,
            wedged_workers=unknown,
        )
    failed.__cause__ = error
    return failed
