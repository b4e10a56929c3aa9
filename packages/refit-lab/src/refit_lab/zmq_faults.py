"""Wire faults for ZeroMQ transports: transparent hops in front of one relay.

A hop sits in front of one relay of refit-zmq's protocol (``PROTOCOL.md``: every message is
2 frames, or 3 for DATA whose third frame is a payload chunk) and forwards every message in
both directions. Publish its address in place of the relay's and every producer,
coordinator and parent reaches the relay through it.

- :class:`CorruptingRelayProxy`, once armed, flips one byte in the next DATA chunk, as a bad
  NIC or a memory error would.
- :class:`PartitioningRelayProxy` cuts the relay off from a given DATA message on: every later
  message, both ways, is held (control requests and aborts included) until the partition is
  healed, when the held messages are delivered late, as TCP would retransmit them.
- :class:`ProxiedRelays` shows a relay generation to a synchronizer with a hop in place of
  its first relay.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import zmq

__all__ = ["CorruptingRelayProxy", "PartitioningRelayProxy", "ProxiedRelays", "RelayHop"]

logger = logging.getLogger(__name__)

_DATA_FRAMES = 3
_POLL_MS = 20

Held = tuple[bool, bytes, list[bytes]]
"""A held message: whether it goes to the relay, the sender's identity, its frames."""


class RelayHop:
    """A ROUTER in front of ``target`` with one DEALER to it per sender.

    Subclasses change messages on their way: :meth:`_to_relay` and :meth:`_to_sender` return
    the frames to pass on, or None to hold them back (:meth:`_release` delivers held ones).

    Args:
        target: the relay's address.
        host: the interface the hop binds (an ephemeral port).
    """

    def __init__(self, target: str, host: str = "127.0.0.1") -> None:
        self._context = zmq.Context()
        self._front = self._context.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._target = target
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._held: deque[Held] = deque()
        self._releasing = False
        self._thread = threading.Thread(target=self._run, name="relay-hop", daemon=True)
        self._thread.start()

    def _to_relay(self, frames: list[bytes]) -> list[bytes] | None:
        """A sender's message on its way to the relay (None: hold it)."""
        return frames

    def _to_sender(self, frames: list[bytes]) -> list[bytes] | None:
        """A relay's reply on its way back (None: hold it)."""
        return frames

    def _hold(self, to_relay: bool, identity: bytes, frames: list[bytes]) -> None:
        with self._lock:
            self._held.append((to_relay, identity, frames))

    def _release(self) -> None:
        """Deliver every held message, in order, from the hop's thread."""
        with self._lock:
            self._releasing = True

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        backs: dict[bytes, zmq.Socket[bytes]] = {}
        senders: dict[zmq.Socket[bytes], bytes] = {}

        def back_of(identity: bytes) -> zmq.Socket[bytes]:
            back = backs.get(identity)
            if back is None:
                back = backs[identity] = self._context.socket(zmq.DEALER)
                back.setsockopt(zmq.LINGER, 0)
                back.connect(self._target)
                senders[back] = identity
                poller.register(back, zmq.POLLIN)
            return back

        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._front in ready:
                    identity, *frames = self._front.recv_multipart()
                    passed = self._to_relay(frames)
                    if passed is None:
                        self._hold(True, identity, frames)
                    else:
                        back_of(identity).send_multipart(passed)
                for back, identity in list(senders.items()):
                    if back in ready:
                        reply = back.recv_multipart()
                        passed = self._to_sender(reply)
                        if passed is None:
                            self._hold(False, identity, reply)
                        else:
                            self._front.send_multipart([identity, *passed])
                with self._lock:
                    held = list(self._held) if self._releasing else []
                    if self._releasing:
                        self._held.clear()
                        self._releasing = False
                for to_relay, identity, frames in held:
                    if to_relay:
                        back_of(identity).send_multipart(frames)
                    else:
                        self._front.send_multipart([identity, *frames])
        finally:
            for back in backs.values():
                back.close()
            self._front.close()

    def close(self) -> None:
        """Stop forwarding and close every socket."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        self._context.term()


class CorruptingRelayProxy(RelayHop):
    """A hop that, once armed, flips one byte of the next DATA chunk to the relay."""

    def __init__(self, target: str, host: str = "127.0.0.1") -> None:
        self._armed = threading.Event()
        self._corrupted = 0
        super().__init__(target, host)

    @property
    def corrupted(self) -> int:
        """DATA chunks corrupted so far."""
        with self._lock:
            return self._corrupted

    def arm(self) -> None:
        """Corrupt the next DATA chunk that passes."""
        self._armed.set()

    def _to_relay(self, frames: list[bytes]) -> list[bytes] | None:
        return self._maybe_corrupt(frames)

    def _maybe_corrupt(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) != _DATA_FRAMES or not frames[2] or not self._armed.is_set():
            return frames
        self._armed.clear()
        chunk = bytearray(frames[2])
        chunk[len(chunk) // 2] ^= 0x40
        with self._lock:
            self._corrupted += 1
        logger.info("corrupted one byte of a %d-byte DATA chunk to %s", len(chunk), self._target)
        return [frames[0], frames[1], bytes(chunk)]


class PartitioningRelayProxy(RelayHop):
    """A hop that cuts the relay off once ``after_data`` DATA messages went through it.

    From then on every message, both ways, is held until :meth:`heal`.
    """

    def __init__(self, target: str, host: str = "127.0.0.1") -> None:
        self._after_data: int | None = None
        self._data_seen = 0
        self._cut = threading.Event()
        super().__init__(target, host)

    @property
    def cut(self) -> bool:
        """Whether the partition is in force."""
        return self._cut.is_set()

    @property
    def held(self) -> int:
        """Messages held back so far (both ways)."""
        with self._lock:
            return len(self._held)

    def partition_after(self, data_messages: int) -> None:
        """Cut the relay off once ``data_messages`` more DATA messages passed (0: now)."""
        with self._lock:
            self._after_data = self._data_seen + data_messages
            if data_messages == 0:
                self._cut.set()

    def heal(self) -> None:
        """End the partition: deliver what was held (late), then forward as before."""
        with self._lock:
            self._after_data = None
        self._cut.clear()
        self._release()

    def _to_relay(self, frames: list[bytes]) -> list[bytes] | None:
        if self._cut.is_set():
            return None
        if len(frames) == _DATA_FRAMES:
            with self._lock:
                self._data_seen += 1
                if self._after_data is not None and self._data_seen > self._after_data:
                    self._cut.set()
                    logger.info(
                        "partition: %s cut off from DATA message %d on",
                        self._target,
                        self._data_seen,
                    )
                    return None
        return frames

    def _to_sender(self, frames: list[bytes]) -> list[bytes] | None:
        return None if self._cut.is_set() else frames


class ProxiedRelays:
    """A relay generation whose first relay is reached through ``proxy`` (the synchronizer
    sees the proxy's address in its place); everything else is the generation's.

    Args:
        generation: lists ``relay_addresses()`` and, optionally, takes ``refit_committed``.
        proxy: a proxy in front of ``generation``'s first relay.
    """

    def __init__(self, generation: Any, proxy: RelayHop) -> None:
        self._generation = generation
        self._proxy = proxy

    def relay_addresses(self) -> list[str]:
        return [self._proxy.address, *self._generation.relay_addresses()[1:]]

    def refit_committed(self, version: int) -> None:
        self._generation.refit_committed(version)
