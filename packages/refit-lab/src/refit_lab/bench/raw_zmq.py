"""The raw pyzmq reference: PUSH/PULL streams of the same bytes, round by round.

A :class:`ZmqStreamSender` binds one PUSH (data) and one PULL (acknowledgements) socket per
receiver and sends ``nbytes`` to every receiver at once, one round per :meth:`round` call,
so a bench can interleave its rounds with the rounds of the code under test. Receivers are
:func:`zmq_receiver` processes (any network namespace). Zero-copy sends (``copy=False``) of
``chunk_bytes`` frames; each receiver copies every frame into one preallocated buffer
(``recv_into``) and acknowledges each round; a round is timed from the first send to the
last acknowledgement. One libzmq I/O thread per side (the pyzmq default).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
import zmq

from refit_lab.bench.harness import TimingStats, gbps
from refit_lab.bench.runtime import ChildGroup, Deadline

__all__ = ["FILL", "ZmqStream", "ZmqStreamSender", "zmq_receiver", "zmq_stream"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
FILL = 0xA5
"""Every byte a sender sends; receivers check it."""
_CHECK_STRIDE = 4099
_POLL_MS = 100
_BLOCK_BYTES = 256 * 1024
"""A transactional receiver's cache-sized block (refit's relay receiver uses the same)."""


def _poll_in(sock: zmq.Socket[bytes], deadline: Deadline, poll: Callable[[], None]) -> None:
    """Wait until ``sock`` has a message, checking ``deadline`` (and ``poll``) meanwhile."""
    while not sock.poll(_POLL_MS, zmq.POLLIN):
        deadline.check()
        poll()


def _fitting(size: int, chunk_bytes: int) -> int:
    if size > chunk_bytes:
        raise RuntimeError(f"zmq receiver: frame of {size} bytes > chunk_bytes")
    return size


class _Transaction:
    """What a bare transactional receiver does with every frame, and nothing more: xxh3-128 of
    every byte, the bits it overwrites copied into warm undo memory, the new bits written, in
    blocks that stay in cache (as refit's relay receiver does); the digest checked per round."""

    def __init__(self, dst: np.ndarray) -> None:
        self._dst = dst
        self._undo = np.zeros_like(dst)  # written once here: warm, as a reused undo arena
        self._expected = xxhash.xxh3_128(np.full(dst.size, FILL, dtype=np.uint8).data).digest()
        self._hasher = xxhash.xxh3_128()

    def take(self, offset: int, frame: memoryview) -> None:
        """Apply one received frame at ``offset``."""
        new = np.frombuffer(frame, dtype=np.uint8)
        for at in range(0, new.size, _BLOCK_BYTES):
            block = new[at : at + _BLOCK_BYTES]
            start, stop = offset + at, offset + at + block.size
            self._hasher.update(block.data)
            self._undo[start:stop] = self._dst[start:stop]
            self._dst[start:stop] = block

    def check(self) -> None:
        """The round's digest must be the stream's; start the next round."""
        if self._hasher.digest() != self._expected:
            raise RuntimeError("zmq transactional receiver: checksum mismatch")
        self._hasher = xxhash.xxh3_128()


def zmq_receiver(
    data_endpoint: str,
    ack_endpoint: str,
    nbytes: int,
    chunk_bytes: int,
    rounds: int,
    timeout_s: float,
    transactional: bool = False,
) -> list[float]:
    """Receiver (a child process): pull ``rounds`` x ``nbytes`` into one buffer, ack each
    round; the CPU seconds (all its threads) of every round but the first. Plain: each frame
    copied into the buffer (``recv_into``). ``transactional``: frames received without a
    copy and applied as :class:`_Transaction` does."""
    deadline = Deadline(timeout_s, "zmq receiver")
    cpu = [time.process_time()]
    dst = np.zeros(nbytes, dtype=np.uint8)
    view = dst.data
    transaction = _Transaction(dst) if transactional else None
    with zmq.Context() as ctx:
        ctx.setsockopt(zmq.LINGER, 0)
        with ctx.socket(zmq.PULL) as data, ctx.socket(zmq.PUSH) as ack:
            ack.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            data.connect(data_endpoint)
            ack.connect(ack_endpoint)
            ack.send(b"ready")
            for round_index in range(rounds):
                offset = 0
                while offset < nbytes:
                    _poll_in(data, deadline, lambda: None)
                    if transaction is None:
                        size = _fitting(
                            data.recv_into(view[offset : offset + chunk_bytes]), chunk_bytes
                        )
                    else:
                        frame = data.recv(copy=False).buffer
                        size = _fitting(len(frame), chunk_bytes)
                        transaction.take(offset, frame)
                    offset += size
                if transaction is not None:
                    transaction.check()
                ack.send(round_index.to_bytes(8, "little"))
                cpu.append(time.process_time())
    if not bool((dst[::_CHECK_STRIDE] == FILL).all()):
        raise RuntimeError("zmq receiver: stream delivered wrong bytes")
    return [end - start for start, end in itertools.pairwise(cpu[1:])]


class ZmqStreamSender:
    """The sending side of raw streams to ``receivers`` receivers (see the module docstring).

    Args:
        nbytes: bytes per receiver per round.
        receivers: how many receivers (each gets every byte, all at once).
        chunk_bytes: frame size.
        ip: the address to bind.
        ports: (first data port, first ack port) to bind, receiver ``i`` at each plus ``i``,
            so receivers can be started before this sender exists; None: ephemeral ports
            (read :attr:`endpoints`).
        deadline: bounds every wait.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        receivers: int = 1,
        chunk_bytes: int = MiB,
        ip: str = "127.0.0.1",
        ports: tuple[int, int] | None = None,
        deadline: Deadline,
    ) -> None:
        if chunk_bytes < 1 or receivers < 1:
            raise ValueError(f"need chunk_bytes and receivers >= 1: {chunk_bytes}, {receivers}")
        self._view = np.full(nbytes, FILL, dtype=np.uint8).data
        self._chunk_bytes = chunk_bytes
        self._deadline = deadline
        self._rounds = 0
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 0)
        self._pushes: list[zmq.Socket[bytes]] = []
        self._acks: list[zmq.Socket[bytes]] = []
        self.endpoints: list[tuple[str, str]] = []
        try:
            for index in range(receivers):
                push, ack = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
                self._pushes.append(push)
                self._acks.append(ack)
                if ports is None:
                    push.bind(f"tcp://{ip}:*")
                    ack.bind(f"tcp://{ip}:*")
                else:
                    push.bind(f"tcp://{ip}:{ports[0] + index}")
                    ack.bind(f"tcp://{ip}:{ports[1] + index}")
                self.endpoints.append(
                    (
                        push.getsockopt_string(zmq.LAST_ENDPOINT),
                        ack.getsockopt_string(zmq.LAST_ENDPOINT),
                    )
                )
        except BaseException:
            self.close()
            raise

    def ready(self, poll: Callable[[], None] = lambda: None) -> None:
        """Wait until every receiver has connected and said so."""
        for ack in self._acks:
            _poll_in(ack, self._deadline, poll)
            if ack.recv() != b"ready":
                raise RuntimeError("zmq reference: receiver did not start with 'ready'")

    def _push_all(self, push: zmq.Socket[bytes], poll: Callable[[], None]) -> None:
        for offset in range(0, len(self._view), self._chunk_bytes):
            chunk = self._view[offset : offset + self._chunk_bytes]
            while True:
                try:
                    push.send(chunk, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    push.poll(_POLL_MS, zmq.POLLOUT)
                    self._deadline.check()
                    poll()

    def round(self, poll: Callable[[], None] = lambda: None) -> tuple[float, float]:
        """One round to every receiver: wall seconds and this process's CPU seconds."""
        expected = self._rounds.to_bytes(8, "little")
        self._rounds += 1
        started, cpu_started = time.perf_counter(), time.process_time()
        if len(self._pushes) == 1:
            self._push_all(self._pushes[0], poll)
        else:
            senders = [
                threading.Thread(target=self._push_all, args=(p, poll)) for p in self._pushes
            ]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(self._deadline.remaining_s())
            if any(sender.is_alive() for sender in senders):
                raise TimeoutError("zmq reference: a sender outlived the deadline")
        for ack in self._acks:
            _poll_in(ack, self._deadline, poll)
            got = ack.recv()
            if got != expected:
                raise RuntimeError(f"zmq reference: expected ack {expected!r}, got {got!r}")
        return time.perf_counter() - started, time.process_time() - cpu_started

    def close(self) -> None:
        """Close every socket and the context."""
        for sock in (*self._pushes, *self._acks):
            sock.close()
        self._context.term()

    def __enter__(self) -> ZmqStreamSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class ZmqStream:
    """The median round of a raw pyzmq stream: wall seconds, rate, and the CPU seconds both
    processes spent (every thread, libzmq's I/O threads included)."""

    seconds: float
    gbps: float
    cpu_s: float


def _default_timeout_s(total_bytes: int) -> float:
    """Generous deadline: process start-up plus the bytes at a pessimistic 50 MB/s."""
    return 60.0 + total_bytes / 50e6


class LoopbackStream:
    """A :class:`ZmqStreamSender` on loopback with its receiver in a child process, for
    ``rounds`` rounds (interleave them with the code under test), and their timings; with
    ``transactional`` the receiver also hashes, keeps undo data and checks (see
    :func:`zmq_receiver`)."""

    def __init__(
        self,
        nbytes: int,
        *,
        rounds: int,
        chunk_bytes: int = MiB,
        timeout_s: float | None = None,
        transactional: bool = False,
    ) -> None:
        self.nbytes = nbytes
        self._deadline = Deadline(timeout_s or _default_timeout_s(nbytes * rounds), "zmq reference")
        self._sender = ZmqStreamSender(nbytes, chunk_bytes=chunk_bytes, deadline=self._deadline)
        ((data, ack),) = self._sender.endpoints
        timeout = self._deadline.remaining_s()
        args = [(data, ack, nbytes, chunk_bytes, rounds, timeout, transactional)]
        self._group = ChildGroup(zmq_receiver, args, deadline=self._deadline, name="zmq-receiver")
        self.seconds: list[float] = []
        self.sender_cpu_s: list[float] = []

    def __enter__(self) -> LoopbackStream:
        try:
            self._group.__enter__()
            self._sender.ready(self._group.poll)
        except BaseException:
            self._sender.close()
            raise
        return self

    def round(self) -> float:
        """One timed round; its wall seconds."""
        seconds, cpu_s = self._sender.round(self._group.poll)
        self.seconds.append(seconds)
        self.sender_cpu_s.append(cpu_s)
        return seconds

    def receiver_cpu_s(self) -> list[float]:
        """The receiver's CPU seconds per round but the first (after the last round)."""
        (cpu,) = self._group.results()
        result: list[float] = cpu
        return result

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        try:
            self._group.__exit__(_type, exc, _tb)
        finally:
            self._sender.close()


def zmq_stream(
    nbytes: int,
    *,
    repeats: int,
    chunk_bytes: int = MiB,
    timeout_s: float | None = None,
) -> ZmqStream:
    """Raw pyzmq stream of ``nbytes`` over tcp loopback to a receiver process, ``repeats``
    timed rounds after a warm-up: the median round (see :class:`ZmqStream`)."""
    with LoopbackStream(
        nbytes, rounds=repeats + 1, chunk_bytes=chunk_bytes, timeout_s=timeout_s
    ) as stream:
        for _ in range(repeats + 1):
            stream.round()
        receiver_cpu = stream.receiver_cpu_s()
    return summarize(stream, receiver_cpu, skip=1)


def summarize(stream: LoopbackStream, receiver_cpu: Sequence[float], *, skip: int) -> ZmqStream:
    """The median of a loopback stream's rounds after the first ``skip`` (warm-up)."""
    seconds = TimingStats.from_samples(stream.seconds[skip:]).median_s
    both = [
        a + b for a, b in zip(stream.sender_cpu_s[skip:], receiver_cpu[skip - 1 :], strict=True)
    ]
    cpu_s = statistics.median(both)
    logger.info(
        "zmq stream %d bytes: %.3f s, %.3f CPU s (median of %d)",
        stream.nbytes,
        seconds,
        cpu_s,
        len(both),
    )
    return ZmqStream(seconds=seconds, gbps=gbps(stream.nbytes, seconds), cpu_s=cpu_s)
