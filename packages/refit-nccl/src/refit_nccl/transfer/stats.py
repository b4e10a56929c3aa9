"""What one side of a transfer did (:class:`TransferStats`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["TransferStats"]


@dataclass(frozen=True)
class TransferStats:
    """What one side of a transfer did; times in seconds.

    Attributes:
        buckets: buckets moved.
        wire_bytes: bytes broadcast (alignment padding included).
        dense_bytes: bytes of the tensors themselves.
        pack_s: sender time spent packing.
        consume_s: receiver time spent in the consumer.
        wait_s: time blocked on the communicator.
        total_s: wall time of the transfer.
    """

    buckets: int
    wire_bytes: int
    dense_bytes: int
    pack_s: float
    consume_s: float
    wait_s: float
    total_s: float

    @classmethod
    def since(
        cls, started: float, buckets: int, wire_bytes: int, dense_bytes: int
    ) -> TransferStats:
        """Stats of a transfer that an engine ran on its own, so only its wall time since
        ``started`` (``time.monotonic()``) is known."""
        elapsed = time.monotonic() - started
        return cls(buckets, wire_bytes, dense_bytes, 0.0, 0.0, elapsed, elapsed)
