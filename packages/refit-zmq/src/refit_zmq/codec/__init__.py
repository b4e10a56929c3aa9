"""Lossless sparse delta codec: payload format, apply with undo, and per-tensor digests.

Producers encode with :class:`refit_zmq.tracker.DeltaCompressionTracker`; receivers call
:func:`apply_payload`. A read-back of what a payload carried uses :func:`decode_payload`,
:func:`unpack_buffer` (a buffer's raw bytes) and :func:`decode_locations` (an item's indices).
"""

from refit_zmq.codec.apply import AppliedPayload, apply_payload, check_item
from refit_zmq.codec.buffers import unpack_buffer
from refit_zmq.codec.device_diff import fetch_diff
from refit_zmq.codec.digest import tensor_digest
from refit_zmq.codec.format import (
    PRELUDE_BYTES,
    BufferCodec,
    BufferInfo,
    DecodedItem,
    DecodedPayload,
    DeltaPayload,
    Encoding,
    ItemHeader,
    PayloadHasher,
    PayloadLayout,
    PlaneInfo,
    StoredBuffer,
    carried_checksum,
    decode_payload,
    head_length,
    read_layout,
)
from refit_zmq.codec.locations import decode_locations
from refit_zmq.codec.undo import UndoEntry, UndoLog

__all__ = [
    "PRELUDE_BYTES",
    "AppliedPayload",
    "BufferCodec",
    "BufferInfo",
    "DecodedItem",
    "DecodedPayload",
    "DeltaPayload",
    "Encoding",
    "ItemHeader",
    "PayloadHasher",
    "PayloadLayout",
    "PlaneInfo",
    "StoredBuffer",
    "UndoEntry",
    "UndoLog",
    "apply_payload",
    "carried_checksum",
    "check_item",
    "decode_locations",
    "decode_payload",
    "fetch_diff",
    "head_length",
    "read_layout",
    "tensor_digest",
    "unpack_buffer",
]
