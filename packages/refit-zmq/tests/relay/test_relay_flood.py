"""A flood against a relay in front of a slow receiver: memory stays bounded, the relay serves.

Six producers push 2 MiB payloads as fast as the relay admits them and a rogue peer blasts
chunks of payloads it never announced, while the receiver takes 0.25 s per payload. The
relay stages at most ``max_inflight_bytes`` (8 MiB) and its sockets queue at most
``hwm_messages`` chunks per peer, so its resident memory may grow by at most
``RSS_BOUND_BYTES`` (stated and measured here, see the README) while hundreds of MiB are offered.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from relay_helpers import KiB, MiB, RelayFleet, RelaySpec

from refit_core import RefitError
from refit_core.backend import Deadline
from refit_zmq.relay import RelayCoordinator, RelayStatus, RelayTuning, ZmqSparseRefitClient
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import Kind, encode

pytestmark = pytest.mark.timeout(120)
logger = logging.getLogger(__name__)

TUNING = RelayTuning(
    chunk_bytes=64 * KiB,
    max_inflight_bytes=8 * MiB,
    window_payloads=4,
    max_pending_admissions=8,
    hwm_messages=16,
    retries=0,
)
FLOOD = "v1-00000000000f100d"
PAYLOAD_BYTES = 2 * MiB
PRODUCERS = 6
FLOOD_S = 4.0
RSS_BOUND_BYTES = TUNING.max_inflight_bytes + 24 * MiB
"""Staging budget, plus socket queues (16 chunks of 64 KiB per peer), plus allocator slack."""


@pytest.fixture(scope="module")
def relay() -> Iterator[RelayFleet]:
    with RelayFleet([RelaySpec(apply_delay_s=0.25, timeout_s=2.0, tuning=TUNING)]) as fleet:
        yield fleet


def _producer(address: str, rank: int, stop: threading.Event, offered: list[int]) -> None:
    body = np.random.default_rng(rank).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8).data
    client = ZmqSparseRefitClient(
        address, timeout_s=1.5, producer_id=f"flood-{rank}", retries=0, tuning=TUNING
    )
    with client:
        for index in itertools.count():
            if stop.is_set():
                return
            with contextlib.suppress(RefitError):
                client.send_payload(
                    transfer_id=FLOOD,
                    payload_id=str(index),
                    checksum="ab" * 16,
                    verification_candidates=0,
                    body=body,
                    deadline=Deadline.never(),
                )
            offered[rank] += PAYLOAD_BYTES


def _rogue(address: str, stop: threading.Event, offered: list[int]) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    chunk = bytes(64 * KiB)
    signer = Signer(None)
    try:
        for index in itertools.count():
            if stop.is_set():
                return
            fields = {
                "transfer_id": FLOOD,
                "producer_id": "rogue",
                "payload_id": str(index),
                "checksum": "cd" * 16,
                "total_bytes": len(chunk),
                "offset": 0,
            }
            if socket.poll(10, zmq.POLLOUT):
                socket.send_multipart(encode(Kind.DATA, fields, signer, chunk), copy=False)
                offered[-1] += len(chunk)
            while socket.poll(0):
                socket.recv_multipart()
    finally:
        socket.close()
        context.term()


def test_flood_against_slow_receiver_keeps_relay_memory_bounded(relay: RelayFleet) -> None:
    address = relay.addresses[0]
    baseline = relay.rss_bytes(0)
    stop = threading.Event()
    offered = [0] * (PRODUCERS + 1)
    threads = [
        threading.Thread(target=_producer, args=(address, rank, stop, offered))
        for rank in range(PRODUCERS)
    ]
    threads.append(threading.Thread(target=_rogue, args=(address, stop, offered)))
    for thread in threads:
        thread.start()
    peak = baseline
    try:
        end = time.monotonic() + FLOOD_S
        while time.monotonic() < end:
            peak = max(peak, relay.rss_bytes(0))
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    peak = max(peak, relay.rss_bytes(0, "VmHWM"))
    growth = peak - baseline
    logger.info("offered %.0f MiB; relay RSS grew %.1f MiB", sum(offered) / MiB, growth / MiB)
    assert sum(offered) > 10 * RSS_BOUND_BYTES, "the flood must offer far more than the bound"
    assert growth <= RSS_BOUND_BYTES, f"relay RSS grew {growth / MiB:.1f} MiB"

    coordinator = RelayCoordinator(api_key=None, timeout_s=3.0, tuning=TUNING)
    try:
        coordinator.configure_tree([address], deadline=Deadline.never())
        (status,) = coordinator.status(deadline=Deadline.never()).values()
    finally:
        coordinator.close()
    assert isinstance(status, RelayStatus), f"the relay stopped answering: {status}"
    assert 0 < status.peak_staged_bytes <= TUNING.max_inflight_bytes
