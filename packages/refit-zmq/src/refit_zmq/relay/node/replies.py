"""Replies a relay sends on its ROUTER: READY, QUEUED, ACK, NACK and DONE, never blocking."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from refit_zmq.codec.format import BytesLike
from refit_zmq.relay.node.staging import PayloadKey
from refit_zmq.relay.node.topology import Topology
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.errors import RETRYABLE, NackCode
from refit_zmq.relay.wire.frames import Kind, encode

__all__ = ["PAYLOAD_FIELDS", "Replies", "payload_ids"]

logger = logging.getLogger(__name__)

PAYLOAD_FIELDS = ("transfer_id", "producer_id", "payload_id")
_UNSIGNED = Signer(None)


def payload_ids(key: PayloadKey) -> dict[str, str]:
    """The id fields of a payload key."""
    return dict(zip(PAYLOAD_FIELDS, key, strict=True))


class Replies:
    """Signs and sends replies to ROUTER peers; a peer whose queue is full loses the reply."""

    def __init__(self, router: zmq.Socket[bytes], signer: Signer, topology: Topology) -> None:
        self._router = router
        self._signer = signer
        self._topology = topology

    def send(
        self, identity: bytes, kind: Kind, fields: dict[str, Any], *, sign: bool = True
    ) -> None:
        """Send one reply to ``identity``."""
        signer = self._signer if sign else _UNSIGNED
        frames: list[BytesLike] = [identity, *encode(kind, fields, signer)]
        try:
            self._router.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("relay %s: reply dropped (peer queue full)", self._topology.own)

    def nack(
        self,
        identity: bytes,
        code: NackCode,
        message: str,
        ids: dict[str, str],
        *,
        sign: bool = True,
    ) -> None:
        """Refuse a request (an AUTH refusal goes unsigned and without ids)."""
        logger.info("relay %s: NACK %s to %s: %s", self._topology.own, code, ids or "peer", message)
        fields = {
            **ids,
            "code": code.value,
            "message": message,
            "relay": self._topology.own,
            "retryable": code in RETRYABLE,
        }
        self.send(identity, Kind.NACK, fields, sign=sign)

    def payload(self, identity: bytes, kind: Kind, key: PayloadKey, **extra: Any) -> None:
        """READY, QUEUED or ACK for one payload."""
        self.send(identity, kind, {**payload_ids(key), "relay": self._topology.own, **extra})

    def done(self, identity: bytes, request_id: str, result: dict[str, Any]) -> None:
        """Answer a control request."""
        fields = {"request_id": request_id, "relay": self._topology.own, "result": result}
        self.send(identity, Kind.DONE, fields)
