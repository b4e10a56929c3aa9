"""The control messages of the IPC channel (``refit-ipc/1``): one JSON object per frame.

Requests (trainer -> worker, on a DEALER socket) and replies (worker -> trainer, on its REP
socket) are JSON objects; nothing is ever unpickled. A request names its ``op``:

- ``begin``: ``version``, ``session``, ``buffers`` (the two ping-pong buffers' handles) and
  ``manifest`` (name -> ``[shape, dtype]`` of every tensor the refit carries);
- ``bucket``: ``version``, ``seq``, ``buffer`` (0 or 1) or ``oneoff`` (a handle of its own),
  and ``items`` (``[name, offset, shape, dtype]`` per tensor in that memory);
- ``commit``: ``version`` and ``count`` (tensors sent): the completion sentinel;
- ``abort``: ``version``: drop the refit.

A reply is ``{"ok": true, "op": ..., "partial": bool, ...}`` or ``{"ok": false, "error": code,
"message": str, "partial": bool}``; ``partial`` says the engine holds weights loaded by a
refit that did not commit.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_core import (
    GeometryMismatchError,
    ProtocolError,
    RefitError,
    StaleBaseError,
    TensorSpec,
    WorkerError,
)

__all__ = [
    "PROTOCOL",
    "ErrorCode",
    "Item",
    "Op",
    "code_for_error",
    "decode",
    "encode",
    "error_for_reply",
    "manifest_from_json",
    "manifest_to_json",
    "parse_items",
    "require",
    "slot_bytes",
    "torch_dtype",
]

PROTOCOL = "refit-ipc/1"


class Op(enum.StrEnum):
    """Request kinds."""

    BEGIN = "begin"
    BUCKET = "bucket"
    COMMIT = "commit"
    ABORT = "abort"


class ErrorCode(enum.StrEnum):
    """Why a worker refused a request (the ``error`` field of a reply)."""

    MALFORMED = "MALFORMED"
    GEOMETRY = "GEOMETRY"
    VERSION = "VERSION"
    LOAD_FAILED = "LOAD_FAILED"


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as a compact JSON frame."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def decode(frame: bytes) -> dict[str, Any]:
    """A frame as a JSON object.

    Raises:
        ProtocolError: not UTF-8 JSON, or not an object.
    """
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(message).__name__}")
    return message


def require(message: Mapping[str, Any], key: str, kind: type[Any]) -> Any:
    """``message[key]``, checked to be a ``kind`` (a bool is never an int here).

    Raises:
        ProtocolError: the field is missing or of another type.
    """
    value = message.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _spec(value: Any) -> TensorSpec:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], list)
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in value[0])
        or not isinstance(value[1], str)
    ):
        raise ProtocolError(f"a tensor spec must be [shape, dtype], got {value!r}")
    try:
        return TensorSpec(tuple(value[0]), value[1])
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc


def manifest_to_json(manifest: Mapping[str, TensorSpec]) -> dict[str, list[Any]]:
    """Name -> ``[shape, dtype]``."""
    return {name: [list(spec.shape), spec.dtype] for name, spec in manifest.items()}


def manifest_from_json(value: Any) -> dict[str, TensorSpec]:
    """The inverse of :func:`manifest_to_json`, validated."""
    if not isinstance(value, dict):
        raise ProtocolError("the manifest must be a JSON object")
    return {str(name): _spec(spec) for name, spec in value.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``).

    Raises:
        ProtocolError: no such dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"unknown dtype {name!r}")
    return dtype


def slot_bytes(spec: TensorSpec) -> int:
    """Bytes a tensor of ``spec`` takes in a buffer (before alignment)."""
    return spec.numel * torch_dtype(spec.dtype).itemsize


@dataclass(frozen=True)
class Item:
    """One tensor in a bucket: ``spec.numel`` elements at byte ``offset`` of the bucket's memory."""

    name: str
    offset: int
    spec: TensorSpec

    def to_json(self) -> list[Any]:
        """``[name, offset, shape, dtype]``."""
        return [self.name, self.offset, list(self.spec.shape), self.spec.dtype]


def parse_items(value: Any) -> list[Item]:
    """A bucket's ``items`` field, validated."""
    if not isinstance(value, list):
        raise ProtocolError("items must be a list")
    items: list[Item] = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str):
            raise ProtocolError(f"an item must be [name, offset, shape, dtype], got {entry!r}")
        offset = entry[1]
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ProtocolError(f"item {entry[0]!r}: bad offset {offset!r}")
        items.append(Item(entry[0], offset, _spec(entry[2:])))
    return items


_BY_ERROR: tuple[tuple[type[RefitError], ErrorCode], ...] = (
    (GeometryMismatchError, ErrorCode.GEOMETRY),
    (StaleBaseError, ErrorCode.VERSION),
    (ProtocolError, ErrorCode.MALFORMED),
)


def code_for_error(error: BaseException) -> ErrorCode:
    """The code that reports ``error``; anything unexpected is a failed load."""
    for kind, code in _BY_ERROR:
        if isinstance(error, kind):
            return code
    return ErrorCode.LOAD_FAILED


def error_for_reply(worker: str, op: str, reply: Mapping[str, Any]) -> RefitError:
    """The typed error a refusal from ``worker`` stands for."""
    message = f"{worker}: {op}: {reply.get('message', 'no message')}"
    code = reply.get("error")
    if code == ErrorCode.GEOMETRY:
        return GeometryMismatchError(message)
    if code == ErrorCode.VERSION:
        return StaleBaseError(message)
    if code == ErrorCode.MALFORMED:
        return ProtocolError(message)
    return WorkerError(str(reply.get("message", "load failed")), worker=worker, operation=op)
