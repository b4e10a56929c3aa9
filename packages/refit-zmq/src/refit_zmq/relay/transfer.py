"""One whole transfer: every producer shard streams at once, then the coordinator decides.

Trackers commit their baselines only after the coordinator committed the transfer on the
relays; on any failure they are aborted, so the next transfer is again a delta against the
version every receiver holds (or a dense resync when asked).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from refit_core.types import NamedTensor
from refit_zmq.relay.coordinator import RelayCoordinator, TransferOutcome, new_transfer_id
from refit_zmq.relay.curve import CurveConfig
from refit_zmq.relay.streaming import stream_sparse_delta_payloads_via_zmq
from refit_zmq.relay.tuning import RelayTuning
from refit_zmq.tracker import DeltaCompressionTracker

__all__ = ["ProducerShard", "TransferOptions", "TransferResult", "run_transfer"]

logger = logging.getLogger(__name__)

Tensors = Iterable[NamedTensor] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ProducerShard:
    """One producer: its tracker and a fresh stream of the new weights."""

    tracker: DeltaCompressionTracker
    tensors: Callable[[], Tensors]


@dataclass(frozen=True)
class TransferOptions:
    """How producers stream.

    Attributes:
        api_key_env_var: the environment variable holding the API key (None: no key).
        timeout_s: longest wait for one reply.
        tuning: chunk size, fan-out, retries.
        curve: the relays' CURVE public key, when they encrypt.
        verification_candidates: entries each receiver re-reads per payload (0: none).
    """

    api_key_env_var: str | None
    timeout_s: float
    tuning: RelayTuning
    curve: CurveConfig | None = None
    verification_candidates: int = 64


@dataclass(frozen=True)
class TransferResult:
    """A committed transfer: the coordinator's outcome, each shard's counts, the timings."""

    outcome: TransferOutcome
    shards: list[dict[str, int]]
    stream_s: float
    finish_s: float

    def total(self, key: str) -> int:
        """A count summed over the shards (``payloads``, ``wire_bytes``, ...)."""
        return sum(shard[key] for shard in self.shards)


def run_transfer(
    coordinator: RelayCoordinator,
    shards: Sequence[ProducerShard],
    *,
    target_version: int,
    resync: bool,
    options: TransferOptions,
    expected_digests: Mapping[str, int] | None = None,
) -> TransferResult:
    """Stream every shard (concurrently, each rooted at its own relay) and finish the transfer.

    Raises:
        RefitError: a producer or a relay failed; the transfer was aborted everywhere, every
            tracker too, and the error names the relays that failed.
    """
    transfer_id = new_transfer_id(target_version)
    started = time.monotonic()
    with ThreadPoolExecutor(len(shards), thread_name_prefix="refit-producer") as pool:
        futures = [
            pool.submit(
                stream_sparse_delta_payloads_via_zmq,
                shard.tensors(),
                delta_tracker=shard.tracker,
                refit_targets=coordinator.relays,
                transfer_id=transfer_id,
                api_key_env_var=options.api_key_env_var,
                timeout_s=options.timeout_s,
                shard_rank=shard.tracker.config.shard_rank,
                shard_count=shard.tracker.config.shard_count,
                target_version=target_version,
                resync=resync,
                verification_candidates=options.verification_candidates,
                tuning=options.tuning,
                curve=options.curve,
            )
            for shard in shards
        ]
        errors = [f.exception() for f in futures]
    streamed = time.monotonic()
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        logger.warning("transfer %s: a producer failed (%s); aborting", transfer_id, failed)
        coordinator.abort(transfer_id)
        for shard in shards:
            shard.tracker.abort()
        raise failed
    stats = [f.result() for f in futures]
    outcome = coordinator.finish(
        transfer_id, sum(s["payloads"] for s in stats), expected_digests=expected_digests
    )
    for shard in shards:
        if outcome.committed:
            shard.tracker.commit()
        else:
            shard.tracker.abort()
    if not outcome.committed:
        raise outcome.error()
    return TransferResult(outcome, stats, streamed - started, time.monotonic() - streamed)
