"""A client of the relay protocol written from its specification alone: plain pyzmq, JSON
headers built by hand, no API key. Only the payload bytes come from refit's codec; the relay
it talks to runs in the test's process."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from relay_helpers import TUNING, digests, make_state

from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import RelayTuning, TensorReceiver, ZmqSparseRefitServer

PROTOCOL = "refit-zmq/2"


class Wire:
    """A plain DEALER speaking the protocol from its specification (no API key)."""

    def __init__(self, address: str) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)

    def send(self, kind: str, mac: bytes = b"", chunk: bytes | None = None, **fields: Any) -> None:
        header = json.dumps({"protocol": PROTOCOL, "kind": kind, **fields}).encode()
        self._socket.send_multipart([header, mac] + ([chunk] if chunk is not None else []))

    def reply(self, timeout_s: float = 10.0) -> dict[str, Any]:
        assert self._socket.poll(int(timeout_s * 1000)), "the relay did not answer"
        header, mac = self._socket.recv_multipart()
        assert mac == b"", "a relay without a key sends no MAC"
        reply: dict[str, Any] = json.loads(header)
        return reply

    def request(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Send a control request; its answer (other replies still queued are dropped)."""
        request_id = f"r{time.monotonic_ns()}"
        self.send(kind, request_id=request_id, **fields)
        while True:
            reply = self.reply()
            if reply.get("request_id") == request_id:
                return reply

    def watch(self, event: int) -> Callable[[float], bool]:
        """Start watching the socket for a libzmq ``event``; the returned call waits up to its
        timeout for it."""
        monitor = self._socket.get_monitor_socket(event)

        def seen(timeout_s: float) -> bool:
            try:
                return bool(monitor.poll(int(timeout_s * 1000)))
            finally:
                self._socket.disable_monitor()
                monitor.close()

        return seen

    def close(self) -> None:
        self._socket.close()
        self._context.term()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def payload_ids(transfer_id: str, payload: DeltaPayload) -> dict[str, Any]:
    """The fields naming one payload (producer ``p``, payload ``0``) in DATA and BEGIN."""
    return {
        "transfer_id": transfer_id,
        "producer_id": "p",
        "payload_id": "0",
        "checksum": payload.checksum,
        "total_bytes": payload.nbytes,
    }


def begin_fields(payload: DeltaPayload, transfer: str, **change: Any) -> dict[str, Any]:
    """A BEGIN for a delta from version 0, with ``change`` applied (``...`` drops a field)."""
    fields = {
        **payload_ids(transfer, payload),
        "verification_candidates": 8,
        "base": 0,
        "target": int(transfer[1 : transfer.index("-")]),
        "deadline_s": 20.0,
    }
    fields.update(change)
    return {k: v for k, v in fields.items() if v is not ...}


def frame_chunks(payload: DeltaPayload) -> list[tuple[int, bytes]]:
    """``(offset, chunk)``: every frame whole, as the specification allows."""
    chunks, offset = [], 0
    for frame in payload.frames:
        data = bytes(memoryview(frame).cast("B"))
        chunks.append((offset, data))
        offset += len(data)
    return chunks


def stream(
    wire: Wire, payload: DeltaPayload, begin: dict[str, Any], chunks: list[tuple[int, bytes]]
) -> dict[str, Any]:
    """BEGIN, READY, every chunk; the final ACK or NACK."""
    wire.send("BEGIN", **begin)
    ready = wire.reply()
    assert ready["kind"] == "READY", ready
    ids = payload_ids(begin["transfer_id"], payload)
    for offset, chunk in chunks:
        wire.send("DATA", chunk=chunk, offset=offset, **ids)
    return wire.reply()


@contextlib.contextmanager
def serving_relay(
    tuning: RelayTuning = TUNING, *, configure: bool = True, timeout_s: float = 30.0
) -> Iterator[tuple[ZmqSparseRefitServer, str]]:
    """A relay (no API key) over ``make_state(91)`` at version 0, and its address; configured
    as a tree of itself alone unless ``configure`` is False."""
    server = ZmqSparseRefitServer(
        TensorReceiver(make_state(91), version=0),
        api_key_env_var=None,
        timeout_s=timeout_s,
        tuning=tuning,
    )
    address = server.start()
    if configure:
        server.configure_tree([address], own_address=address)
    try:
        yield server, address
    finally:
        server.close()


def untouched(server: ZmqSparseRefitServer) -> bool:
    """Nothing applied: the receiver holds ``make_state(91)`` at version 0, nothing open."""
    status = server.status(digests=True)
    return (status.version, status.open, status.digests) == (0, None, digests(make_state(91)))


def nack(reply: dict[str, Any], code: str, text: str) -> None:
    """``reply`` is a NACK of ``code`` whose message says ``text``."""
    assert (reply["kind"], reply["code"]) == ("NACK", code), reply
    assert text in reply["message"], reply["message"]
