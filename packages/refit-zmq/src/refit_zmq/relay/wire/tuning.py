"""Tuning of relays, clients and the coordinator: one frozen dataclass, shared by every side."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RelayTuning"]

_MiB = 1 << 20


@dataclass(frozen=True)
class RelayTuning:
    """Sizes, fan-out and retry policy of the relay tree.

    Attributes:
        fanout: children per relay in each tree (1 makes a pipelined chain).
        chunk_bytes: largest DATA chunk; senders cut payloads into chunks of at most this
            size and relays refuse larger frames (``ZMQ_MAXMSGSIZE``).
        max_inflight_bytes: payload bytes a relay stages at once (received, being applied or
            still being forwarded); a payload is admitted (READY) only when it fits.
        window_payloads: payloads of one tree (one root) staged at once, so one slow subtree
            cannot take every byte of the budget.
        max_pending_admissions: BEGINs waiting for room; beyond that a relay answers BUSY.
        hwm_messages: send and receive high-water mark of every socket, in messages.
        retries: further attempts of a request after its first timeout.
        backoff_s: first pause before a retry; doubles up to ``max_backoff_s``.
        max_backoff_s: longest pause before a retry.
        reconnect_s: first pause before a link reconnects to a relay it lost (libzmq's
            ``ZMQ_RECONNECT_IVL``); doubles up to ``reconnect_max_s``.
        reconnect_max_s: longest pause between reconnect attempts.
        heartbeat_s: interval of ZMTP heartbeats on every connection.
        heartbeat_timeout_s: a connection silent this long (no heartbeat answered, no
            handshake completed, no TCP connect) is dropped.
    """

    fanout: int = 2
    chunk_bytes: int = _MiB
    max_inflight_bytes: int = 512 * _MiB
    window_payloads: int = 2
    max_pending_admissions: int = 64
    hwm_messages: int = 64
    retries: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    reconnect_s: float = 0.1
    reconnect_max_s: float = 2.0
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.fanout <= 64:
            raise ValueError(f"fanout must be within [1, 64], got {self.fanout}")
        if self.chunk_bytes < 4096 or self.max_inflight_bytes < self.chunk_bytes:
            raise ValueError("need chunk_bytes >= 4096 and max_inflight_bytes >= chunk_bytes")
        if min(self.window_payloads, self.max_pending_admissions, self.hwm_messages) < 1:
            raise ValueError(f"window, pending admissions and HWM must be >= 1: {self}")
        if self.retries < 0 or not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"invalid retry policy: {self}")
        if not 0 < self.reconnect_s <= self.reconnect_max_s:
            raise ValueError(f"need 0 < reconnect_s <= reconnect_max_s: {self}")
        if not 0 < self.heartbeat_s < self.heartbeat_timeout_s:
            raise ValueError(f"need 0 < heartbeat_s < heartbeat_timeout_s: {self}")

    def backoff(self, attempt: int) -> float:
        """Pause before retry number ``attempt`` (from 0)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2**attempt))
