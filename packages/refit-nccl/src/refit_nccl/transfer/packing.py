"""Copy tensors into a bucket's bytes and view them back out, without extra copies.

CPU copies of contiguous tensors go through numpy (one single-threaded memmove each): torch's
parallel ``copy_`` wakes its thread pool for every tensor above its grain size, which on a
busy machine, with every rank running its own pool, turned a 25 ms packing pass into seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit_core import ProtocolError
from refit_core.backend import dtype_name
from refit_nccl.group.tensors import wire_view
from refit_nccl.transfer.plan import PackedBucket, Slot

__all__ = ["check_tensor", "pack_bucket", "slot_view", "unpack_bucket"]


def slot_view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The slot's bytes of a uint8 ``buffer`` as a tensor of the slot's dtype and shape."""
    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    return raw.view(slot.dtype).view(slot.spec.shape)


def _plain_cpu(tensor: torch.Tensor) -> bool:
    """Whether numpy can see ``tensor``'s bytes as they are (contiguous, CPU, no lazy bits)."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not (tensor.is_conj() or tensor.is_neg())
    )


def check_tensor(slot: Slot, name: str, tensor: torch.Tensor) -> None:
    """Raise ProtocolError unless ``(name, tensor)`` is what ``slot`` expects."""
    if name != slot.name or tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.spec.shape:
        raise ProtocolError(
            f"source yielded {name!r} {dtype_name(tensor.dtype)}{tuple(tensor.shape)} where the "
            f"plan expects {slot.name!r} {slot.spec.dtype}{slot.spec.shape}"
        )


def pack_bucket(
    bucket: PackedBucket, tensors: Sequence[torch.Tensor], buffer: torch.Tensor
) -> None:
    """Copy ``tensors`` (any layout or device) into their slots of ``buffer``."""
    raw = buffer.numpy() if _plain_cpu(buffer) else None
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        source = tensor.detach()
        if raw is not None and _plain_cpu(source):
            raw[slot.offset : slot.offset + slot.nbytes] = wire_view(source).numpy()
        else:
            slot_view(buffer, slot).copy_(source)


def unpack_bucket(bucket: PackedBucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` of every tensor of a received bucket; the views alias ``buffer``."""
    return [(slot.name, slot_view(buffer, slot)) for slot in bucket.slots]
