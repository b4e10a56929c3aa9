"""Wire faults for ZeroMQ transports: a transparent hop that can corrupt one DATA chunk.

:class:`CorruptingRelayProxy` sits in front of one relay of refit-zmq's protocol
(``PROTOCOL.md``: every message is 2 frames, or 3 for DATA whose third frame is a payload
chunk). It forwards every message unchanged, except that once armed it flips one byte in
the next DATA chunk, as a bad NIC or a memory error would. Publish its address in place of
the relay's and every producer, coordinator and parent reaches the relay through it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

__all__ = ["CorruptingRelayProxy", "ProxiedRelays"]

logger = logging.getLogger(__name__)

_DATA_FRAMES = 3
_POLL_MS = 20


class CorruptingRelayProxy:
    """A ROUTER in front of ``target`` with one DEALER to it per sender.

    Args:
        target: the relay's address.
        host: the interface the proxy binds (an ephemeral port).
    """

    def __init__(self, target: str, host: str = "127.0.0.1") -> None:
        self._context = zmq.Context()
        self._front = self._context.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._target = target
        self._armed = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._corrupted = 0
        self._thread = threading.Thread(target=self._run, name="corrupting-proxy", daemon=True)
        self._thread.start()

    @property
    def corrupted(self) -> int:
        """DATA chunks corrupted so far."""
        with self._lock:
            return self._corrupted

    def arm(self) -> None:
        """Corrupt the next DATA chunk that passes."""
        self._armed.set()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        backs: dict[bytes, zmq.Socket[bytes]] = {}
        senders: dict[zmq.Socket[bytes], bytes] = {}
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if self._front in ready:
                    identity, *frames = self._front.recv_multipart()
                    back = backs.get(identity)
                    if back is None:
                        back = backs[identity] = self._context.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self._target)
                        senders[back] = identity
                        poller.register(back, zmq.POLLIN)
                    back.send_multipart(self._maybe_corrupt(frames))
                for back, identity in senders.items():
                    if back in ready:
                        self._front.send_multipart([identity, *back.recv_multipart()])
        finally:
            for back in backs.values():
                back.close()
            self._front.close()

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

    def close(self) -> None:
        """Stop forwarding and close every socket."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        self._context.term()


class ProxiedRelays:
    """A relay generation whose first relay is reached through ``proxy`` (the synchronizer
    sees the proxy's address in its place); everything else is the generation's.

    Args:
        generation: lists ``relay_addresses()`` and, optionally, takes ``refit_committed``.
        proxy: a proxy in front of ``generation``'s first relay.
    """

    def __init__(self, generation: Any, proxy: CorruptingRelayProxy) -> None:
        self._generation = generation
        self._proxy = proxy

    def relay_addresses(self) -> list[str]:
        return [self._proxy.address, *self._generation.relay_addresses()[1:]]

    def refit_committed(self, version: int) -> None:
        self._generation.refit_committed(version)
