"""Lossless sparse delta codec: payload format, apply with undo, and per-tensor digests.

Producers encode with :class:`refit_zmq.tracker.DeltaCompressionTracker`; receivers call
:func:`apply_payload`. A read-back of what a payload carried uses :func:`decode_payload`,
:func:`unpack_buffer` (a buffer's raw bytes) and :func:`decode_locations` (an item's indices).
"""

from refit_zmq.codec.apply import AppliedPayload, apply_payload
from refit_zmq.codec.buffers import unpack_buffer
from refit_zmq.codec.digest import tensor_digest
from refit_zmq.codec.format import (
    BufferCodec,
    BufferInfo,
    DecodedItem,
    DecodedPayload,
    DeltaPayload,
    Encoding,
    ItemHeader,
    PayloadHasher,
    PlaneInfo,
    StoredBuffer,
    decode_payload,
)
from refit_zmq.codec.locations import decode_locations
from refit_zmq.codec.undo import UndoEntry, UndoLog

__all__ = [
    "AppliedPayload",
    "BufferCodec",
    "BufferInfo",
    "DecodedItem",
    "DecodedPayload",
    "DeltaPayload",
    "Encoding",
    "ItemHeader",
    "PayloadHasher",
    "PlaneInfo",
    "StoredBuffer",
    "UndoEntry",
    "UndoLog",
    "apply_payload",
    "decode_locations",
    "decode_payload",
    "tensor_digest",
    "unpack_buffer",
]
