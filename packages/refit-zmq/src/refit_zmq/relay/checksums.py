"""The checksum that names a payload: the xxh3-128 a delta payload carries in its prelude.

``codec.format`` documents the prelude: magic (4 bytes), format (2), reserved (2), header
length (4), then the xxh3-128 of every other byte of the payload (16). Reading it costs
nothing; the receiver's apply verifies it against the bytes.
"""

from __future__ import annotations

from refit_zmq.codec.format import BytesLike, DeltaPayload

__all__ = ["embedded_checksum", "payload_checksum"]

_AT = 12
_SIZE = 16


def embedded_checksum(head: BytesLike) -> str | None:
    """The checksum in the prelude at the start of ``head`` (32 hex digits); None if too short."""
    view = memoryview(head).cast("B")
    if len(view) < _AT + _SIZE:
        return None
    return bytes(view[_AT : _AT + _SIZE]).hex()


def payload_checksum(payload: DeltaPayload) -> str:
    """A payload's checksum, as :class:`~refit_zmq.relay.client.ZmqSparseRefitClient` sends it."""
    checksum = embedded_checksum(payload.frames[0])
    if checksum is None:
        raise ValueError("not a delta payload (frame 0 is shorter than its prelude)")
    return checksum
