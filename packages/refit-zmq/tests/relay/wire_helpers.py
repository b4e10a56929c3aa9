"""A client of the relay protocol written from its specification alone: plain pyzmq, JSON
headers built by hand, no API key. Only the payload bytes come from refit's codec."""

from __future__ import annotations

import json
import time
from typing import Any

import zmq

from refit_zmq.codec import DeltaPayload

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

    def close(self) -> None:
        self._socket.close()
        self._context.term()


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
