"""One whole transfer: every producer streams its shard at once, then the coordinator decides.

Producers are :class:`~refit_zmq.relay.producer.ShardProducer` objects reached as
participants (Ray actors on the trainer ranks, or objects in this process). Their trackers
commit their baselines only after the coordinator committed the transfer on the relays; on
any failure they are aborted, so the next transfer is again a delta against the version
every receiver holds (or a dense resync when asked).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from refit_core import RefitError, RefitTimeoutError, WorkerError
from refit_core.backend import Participant, gather, method_name
from refit_zmq.relay.coordinator import RelayCoordinator, TransferOutcome, new_transfer_id
from refit_zmq.relay.producer import ShardProducerRole, StreamOrder, TransferOptions

__all__ = ["TransferResult", "run_transfer"]

logger = logging.getLogger(__name__)


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


def run_transfer(
    coordinator: RelayCoordinator,
    producers: Sequence[Participant[ShardProducerRole]],
    *,
    target_version: int,
    resync: bool,
    options: TransferOptions,
    expected_digests: Mapping[str, int] | None = None,
    wait_s: float | None = None,
) -> TransferResult:
    """Let every producer stream (concurrently, each rooted at its own relay) and finish.

    Args:
        wait_s: longest wait for the producers' streams (the refit's deadline); a producer
            still streaming then is named as wedged.

    Raises:
        RefitError: a producer or a relay failed; the transfer was aborted everywhere, every
            tracker too, and the error names the relays or producers that failed.
    """
    transfer_id = new_transfer_id(target_version)
    order = StreamOrder(transfer_id, coordinator.relays, target_version, resync, options)
    started = time.monotonic()
    streams = gather({p: p.call(ShardProducerRole.refit_stream, order) for p in producers}, wait_s)
    streamed = time.monotonic()
    if not streams.ok:
        logger.warning("transfer %s: a producer failed; aborting", transfer_id)
        coordinator.abort(transfer_id)
        answered = [p for p in producers if p not in streams.missing]
        _settle(answered, commit=False, wait_s=options.timeout_s)
        raise _producer_error(streams.errors, [p.label for p in streams.missing], wait_s)
    stats = [streams.results[p] for p in producers]
    outcome = coordinator.finish(
        transfer_id, sum(s["payloads"] for s in stats), expected_digests=expected_digests
    )
    unsettled = _settle(producers, commit=outcome.committed, wait_s=options.timeout_s)
    if not outcome.committed:
        raise outcome.error()
    return TransferResult(
        outcome, stats, streamed - started, time.monotonic() - streamed, unsettled
    )


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
    wait_s: float | None,
) -> RefitError:
    """The error a failed stream raises: a producer's own refit error first, else a timeout
    naming the producers that never answered, else the first failure (a dead rank) named."""
    own = next((e for e in errors.values() if isinstance(e, RefitError)), None)
    if own is not None:
        return own
    if missing:
        return RefitTimeoutError(
            f"producers {list(missing)} still streaming after {wait_s} s", wedged_workers=missing
        )
    participant, error = next(iter(errors.items()))
    return WorkerError(
        f"{type(error).__name__}: {error}",
        worker=participant.label,
        operation=method_name(ShardProducerRole.refit_stream),
    )
