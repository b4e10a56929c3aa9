"""CUDA buffers as IPC handles, carried as JSON (the GPU side of the channel).

The sender calls torch's own reduction (``torch.multiprocessing.reductions.reduce_tensor``)
on a 1-D uint8 CUDA buffer and keeps only its plain fields: the ``cudaIpcMemHandle`` bytes,
sizes and offsets, torch's IPC reference-counter handle and the event handle, base64-encoded.
The receiver rebuilds the tensor with ``rebuild_cuda_tensor`` from those validated fields;
no pickle crosses the socket. The GPU is named by UUID, since the two processes may number
their visible devices differently. A CUDA IPC handle only opens on the same host, and the
receiver only takes handles from requests on its own control socket.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from refit_core import ProtocolError

__all__ = ["CudaHandle", "attach_cuda", "share_cuda"]


@dataclass(frozen=True)
class CudaHandle:
    """The fields of torch's CUDA reduction of a 1-D uint8 buffer of ``nbytes``."""

    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """The handle as a JSON object (``kind`` ``"cuda"``, bytes in base64)."""
        return {
            "kind": "cuda",
            "device_uuid": self.device_uuid,
            "handle": _b64(self.handle),
            "storage_size_bytes": self.storage_size_bytes,
            "storage_offset_bytes": self.storage_offset_bytes,
            "tensor_offset": self.tensor_offset,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": None if self.event_handle is None else _b64(self.event_handle),
            "event_sync_required": self.event_sync_required,
            "nbytes": self.nbytes,
        }


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share_cuda(buffer: torch.Tensor) -> CudaHandle:
    """The IPC handle of a contiguous 1-D uint8 CUDA ``buffer`` (kept alive by the caller)."""
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("share_cuda takes a 1-D uint8 CUDA tensor")
    _, args = reduce_tensor(buffer)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return CudaHandle(
        device_uuid=_device_uuid(args[6]),
        handle=args[7],
        storage_size_bytes=args[8],
        storage_offset_bytes=args[9],
        tensor_offset=args[3],
        ref_counter_handle=args[11],
        ref_counter_offset=args[12],
        event_handle=args[13],
        event_sync_required=bool(args[14]),
        nbytes=buffer.numel(),
    )


def _local_device(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise ProtocolError(f"GPU {uuid} is not visible to this process")


def attach_cuda(handle: CudaHandle) -> torch.Tensor:
    """Open a sender's CUDA buffer (in the receiving process) as a 1-D uint8 tensor.

    Raises:
        ProtocolError: the GPU is not visible here.
    """
    device = _local_device(handle.device_uuid)
    tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]  # untyped in torch
        torch.Tensor,
        torch.Size([handle.nbytes]),
        (1,),
        handle.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        handle.handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )
    return tensor
