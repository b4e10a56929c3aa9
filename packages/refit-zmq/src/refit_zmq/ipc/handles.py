"""Buffers the trainer fills and workers map: allocation, JSON handles, attachment.

On CPU a buffer is a memfd (:mod:`.shm`); on a GPU a CUDA allocation shared by IPC handle
(:mod:`.cuda_ipc`). Either way the worker gets a 1-D uint8 tensor over the same memory.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import torch

from refit_core import ProtocolError
from refit_zmq.ipc.cuda_ipc import CudaHandle, attach_cuda, share_cuda
from refit_zmq.ipc.protocol import require
from refit_zmq.ipc.shm import ShmBuffer, ShmHandle, attach_shm

__all__ = ["BufferHandle", "SharedBuffer", "attach", "handle_from_json"]

BufferHandle = ShmHandle | CudaHandle


class SharedBuffer:
    """A 1-D uint8 buffer of ``nbytes`` on ``device`` and the handle a worker maps it by."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._shm: ShmBuffer | None = None
        if device.type == "cpu":
            self._shm = ShmBuffer(nbytes)
            self.tensor = self._shm.tensor
            self.handle: BufferHandle = self._shm.handle
        elif device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.handle = share_cuda(self.tensor)
        else:
            raise ValueError(f"IPC buffers live on cpu or cuda, not {device}")

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.tensor.numel()

    def close(self) -> None:
        """Release this side's hold on the memory (workers' mappings keep theirs)."""
        if self._shm is not None:
            self._shm.close()


def _int(value: Mapping[str, Any], key: str) -> int:
    number: int = require(value, key, int)
    if number < 0:
        raise ProtocolError(f"field {key!r} must be >= 0, got {number}")
    return number


def _bytes(value: Mapping[str, Any], key: str) -> bytes:
    try:
        return base64.b64decode(require(value, key, str), validate=True)
    except binascii.Error as exc:
        raise ProtocolError(f"field {key!r} is not base64") from exc


def handle_from_json(value: Any) -> BufferHandle:
    """A handle from its JSON object, validated.

    Raises:
        ProtocolError: an unknown kind or a malformed field.
    """
    if not isinstance(value, dict):
        raise ProtocolError("a buffer handle must be a JSON object")
    kind = value.get("kind")
    if kind == "shm":
        return ShmHandle(
            _int(value, "pid"), _int(value, "fd"), _int(value, "inode"), _int(value, "nbytes")
        )
    if kind == "cuda":
        event = value.get("event_handle")
        return CudaHandle(
            device_uuid=require(value, "device_uuid", str),
            handle=_bytes(value, "handle"),
            storage_size_bytes=_int(value, "storage_size_bytes"),
            storage_offset_bytes=_int(value, "storage_offset_bytes"),
            tensor_offset=_int(value, "tensor_offset"),
            ref_counter_handle=_bytes(value, "ref_counter_handle"),
            ref_counter_offset=_int(value, "ref_counter_offset"),
            event_handle=None if event is None else _bytes(value, "event_handle"),
            event_sync_required=require(value, "event_sync_required", bool),
            nbytes=_int(value, "nbytes"),
        )
    raise ProtocolError(f"unknown buffer kind {kind!r}")


def attach(handle: BufferHandle) -> torch.Tensor:
    """The buffer ``handle`` names, as a 1-D uint8 tensor of this process."""
    if isinstance(handle, ShmHandle):
        return attach_shm(handle)
    return attach_cuda(handle)
