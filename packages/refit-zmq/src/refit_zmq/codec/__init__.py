"""Lossless sparse delta codec: payload format, apply with undo, and per-tensor digests.

Producers encode with :class:`refit_zmq.tracker.DeltaCompressionTracker`; receivers call
:func:`apply_payload`.
"""

from refit_zmq.codec.apply import AppliedPayload, apply_payload
from refit_zmq.codec.digest import tensor_digest
from refit_zmq.codec.format import (
    BufferCodec,
    BufferInfo,
    DecodedItem,
    DecodedPayload,
    DeltaPayload,
    Encoding,
    ItemHeader,
    PlaneInfo,
    StoredBuffer,
    decode_payload,
)
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
    "PlaneInfo",
    "StoredBuffer",
    "UndoEntry",
    "UndoLog",
    "apply_payload",
    "decode_payload",
    "tensor_digest",
]
