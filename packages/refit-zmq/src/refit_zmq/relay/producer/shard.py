"""One trainer rank's half of a sparse refit: its shard's tracker, driven by the coordinator.

A :class:`ShardProducer` lives in the trainer rank's process (a Ray actor serving its
``refit_*`` methods, or an object in the controller's process for a single-process trainer).
The controller reaches it as a ``Participant[ShardProducerRole]``, sends a
:class:`StreamOrder` per transfer, and once the coordinator decided, tells it to commit or
abort its tracker's baseline. Everything it receives is plain, picklable data.

One stream at a time uses the tracker. A stream the controller gave up on (its refit timed
out while it was still encoding) may still be running when the next order arrives: the new
stream stops it (at its next tensor or payload), waits for it to abort its own pending refit,
and only then starts, so no refit's encoding is ever seen by the next.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from refit_core import RefitTimeoutError
from refit_core.backend import Deadline, PolicyLike
from refit_zmq.codec import tensor_digest
from refit_zmq.codec.diff import prepare_kernel
from refit_zmq.relay.producer.streaming import stream_sparse_delta_payloads_via_zmq
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.tuning import RelayTuning
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

__all__ = ["ShardProducer", "ShardProducerRole", "StreamOrder", "TransferOptions"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferOptions:
    """How producers stream.

    Attributes:
        api_key_env_var: the environment variable holding the API key (None: no key); each
            producer reads it in its own process.
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
class StreamOrder:
    """What one producer streams in one transfer (sent to every producer alike).

    ``deadline_s`` is the refit's deadline in its wire form (``Deadline.to_wire``: the
    seconds left when the order was made, None: none); the producer counts it from when it
    gets the order (``Deadline.from_wire``).
    """

    transfer_id: str
    relays: tuple[str, ...]
    target_version: int
    resync: bool
    options: TransferOptions
    deadline_s: float | None = None


class ShardProducerRole(Protocol):
    """What the controller calls on a trainer rank's producer (:class:`ShardProducer` plays
    it; a trainer's own Ray actor may forward the same methods)."""

    def refit_init(self, config: TrackerConfig) -> None:
        """(Re)build the rank's tracker for shard ``config.shard_rank``."""
        ...

    def refit_version(self) -> int | None:
        """The version of the baseline this shard's deltas are taken against."""
        ...

    def refit_stream(self, order: StreamOrder) -> dict[str, int]:
        """Encode and deliver this shard; its counts."""
        ...

    def refit_digests(self) -> dict[str, int]:
        """Every tensor's digest as this rank sees the weights."""
        ...

    def refit_commit(self) -> None:
        """The relays committed the transfer: adopt it as the baseline."""
        ...

    def refit_abort(self) -> None:
        """The transfer was aborted: keep the previous baseline (idempotent)."""
        ...

    def refit_close(self) -> None:
        """Drop the tracker and its baseline."""
        ...


class ShardProducer(ShardProducerRole):
    """A trainer rank's producer: encodes its shard of ``policy``'s weights into the tree.

    Args:
        policy: the rank's trainer; ``weight_source()`` is read once per transfer.
    """

    def __init__(self, policy: PolicyLike) -> None:
        # The change-detection kernel compiles once per process (3-4 s when numba's cache is
        # cold): here, before any refit's deadline runs, for 2- and 4-byte elements (bf16,
        # fp16, fp32 weights); other sizes compile when a tracker of them is built.
        prepare_kernel((2, 4))
        self._policy = policy
        self._tracker: DeltaCompressionTracker | None = None
        self._streaming = threading.Lock()
        self._orders = threading.Lock()
        self._stops: list[threading.Event] = []

    def refit_init(self, config: TrackerConfig) -> None:
        """(Re)build this rank's tracker for shard ``config.shard_rank`` of ``shard_count``;
        with no baseline, its first transfer is a dense resync."""
        self.refit_close()
        spec = self._policy.weight_source().state_dict_info()
        self._tracker = DeltaCompressionTracker(spec, config)

    @property
    def tracker(self) -> DeltaCompressionTracker:
        """This shard's tracker (after ``refit_init``)."""
        return self._require()

    def refit_version(self) -> int | None:
        """The version of the baseline this shard's deltas are taken against."""
        version = self._require().version
        return None if version is None else version.value

    def refit_stream(self, order: StreamOrder) -> dict[str, int]:
        """Encode and deliver this shard; the tracker is left pending (see ``refit_commit``).

        Returns:
            ``payloads``, ``tensors``, ``changed_elements``, ``wire_bytes``, ``dense_bytes``.
        """
        tracker = self._require()
        deadline = Deadline.from_wire(order.deadline_s)
        stop = threading.Event()
        with self._orders:  # every earlier stream still running or waiting stops
            for earlier in self._stops:
                earlier.set()
            self._stops.append(stop)
        left = deadline.remaining_s()
        try:
            if not self._streaming.acquire(timeout=-1 if left is None else left):
                raise RefitTimeoutError(
                    f"producer of shard {tracker.config.shard_rank}: the stream of an earlier "
                    f"refit did not stop by the deadline of {order.transfer_id}"
                )
            try:
                return self._stream(tracker, order, deadline, stop)
            finally:
                self._streaming.release()
        finally:
            with self._orders:
                self._stops.remove(stop)

    def _stream(
        self,
        tracker: DeltaCompressionTracker,
        order: StreamOrder,
        deadline: Deadline,
        stop: threading.Event,
    ) -> dict[str, int]:
        if tracker.pending is not None:
            logger.warning(
                "producer of shard %d: dropping the unsettled refit to %s (its transfer failed)",
                tracker.config.shard_rank,
                tracker.pending,
            )
            tracker.abort()
        options = order.options
        return stream_sparse_delta_payloads_via_zmq(
            self._policy.weight_source().iter_tensors(),
            delta_tracker=tracker,
            refit_targets=order.relays,
            transfer_id=order.transfer_id,
            api_key_env_var=options.api_key_env_var,
            timeout_s=options.timeout_s,
            shard_rank=tracker.config.shard_rank,
            shard_count=tracker.config.shard_count,
            target_version=order.target_version,
            resync=order.resync,
            verification_candidates=options.verification_candidates,
            tuning=options.tuning,
            curve=options.curve,
            deadline=deadline,
            stop=stop,
        )

    def refit_digests(self) -> dict[str, int]:
        """Every tensor's digest as this rank sees the weights (what receivers must hold)."""
        return {
            named.name: tensor_digest(named.tensor)
            for named in self._policy.weight_source().iter_tensors()
        }

    def refit_commit(self) -> None:
        """The relays committed the transfer: adopt it as the baseline."""
        self._require().commit()

    def refit_abort(self) -> None:
        """The transfer was aborted: keep the previous baseline (idempotent)."""
        if self._tracker is not None:
            self._tracker.abort()

    def refit_close(self) -> None:
        """Drop the tracker and its baseline."""
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def _require(self) -> DeltaCompressionTracker:
        if self._tracker is None:
            raise RuntimeError("refit_init was not called on this producer")
        return self._tracker
