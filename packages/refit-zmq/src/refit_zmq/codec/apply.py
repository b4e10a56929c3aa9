"""Apply a delta payload to a receiver's tensors, in place, optionally recording undo data.

The payload is verified (checksum), every item is checked against the receiver's tensors and
version, and every buffer is decoded before the first tensor is written, so a refused payload
touches nothing. Writes are vectorized scatters (numpy on CPU, torch ``index_copy_`` on other
devices) and slice copies on integer views, so they work on any device and keep every bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from refit_core import GeometryMismatchError, StaleBaseError, WeightVersion
from refit_zmq.codec.buffers import unpack_buffer
from refit_zmq.codec.digest import tensor_digest
from refit_zmq.codec.dtypes import int_dtype, int_view, unsigned_numpy_dtype
from refit_zmq.codec.format import (
    BytesLike,
    DecodedItem,
    DecodedPayload,
    DeltaPayload,
    ItemHeader,
    decode_payload,
)
from refit_zmq.codec.locations import decode_locations
from refit_zmq.codec.scatter import gather, read_range, scatter, write_range
from refit_zmq.codec.undo import UndoEntry, UndoLog

__all__ = ["AppliedPayload", "apply_payload", "check_item"]


@dataclass(frozen=True)
class AppliedPayload:
    """What one apply did.

    Attributes:
        items: the headers of the applied items.
        tensors: the receiver's tensors the payload wrote, by name.
        nbytes: payload bytes received.
    """

    items: tuple[ItemHeader, ...]
    tensors: Mapping[str, torch.Tensor]
    nbytes: int

    @property
    def targets(self) -> frozenset[WeightVersion]:
        """Target versions named by the items (one, for a well-formed refit)."""
        return frozenset(item.target for item in self.items)

    def digests(self) -> dict[str, int]:
        """xxh3-64 :func:`tensor_digest` of every written tensor as it is now."""
        return {name: tensor_digest(tensor) for name, tensor in self.tensors.items()}


class _FlatTarget:
    """A tensor's elements addressed by row-major flat index, through a flat integer view."""

    def __init__(self, tensor: torch.Tensor) -> None:
        bits = int_view(tensor.detach())
        self.contiguous = bits.is_contiguous()
        if self.contiguous:
            self.flat = bits.view(-1)
            return
        storage_len = bits.untyped_storage().nbytes() // bits.element_size()
        self.flat = bits.as_strided((storage_len,), (1,), 0)
        self._offset = bits.storage_offset()
        self._shape = tuple(bits.shape)
        self._stride = bits.stride()

    def positions(self, flat_index: torch.Tensor) -> torch.Tensor:
        """Positions in ``flat`` of the given row-major element indices."""
        if self.contiguous:
            return flat_index
        position = torch.full_like(flat_index, self._offset)
        rest = flat_index
        for size, stride in zip(reversed(self._shape), reversed(self._stride), strict=True):
            position += (rest % size) * stride
            rest = rest // size
        return position


@dataclass(frozen=True)
class _Write:
    """One decoded item, ready to write: tensor-relative indices (None: a range) and values."""

    item: ItemHeader
    indices: torch.Tensor | None
    values: torch.Tensor


def check_item(
    item: ItemHeader, tensors: Mapping[str, torch.Tensor], current: WeightVersion | None
) -> None:
    """Refuse an item built against another version or for another tensor geometry.

    Raises:
        StaleBaseError: the item is a delta against another version than ``current``.
        GeometryMismatchError: no tensor of that name, or another dtype or shape.
    """
    if item.base is not None and item.base != current:
        raise StaleBaseError(
            f"payload item {item.name!r} needs base version "
            f"{item.base.value}, receiver holds {None if current is None else current.value}"
        )
    tensor = tensors.get(item.name)
    if tensor is None:
        raise GeometryMismatchError(f"payload item {item.name!r} has no receiving tensor")
    if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
        raise GeometryMismatchError(
            f"payload item {item.name!r} is {item.dtype} {item.shape}, "
            f"receiver holds {tensor.dtype} {tuple(tensor.shape)}"
        )


def _as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor of ``array`` on ``device`` (copying read-only received buffers first)."""
    return torch.from_numpy(np.require(array, requirements="W")).to(device, non_blocking=True)


def _decode(decoded: DecodedItem, device: torch.device) -> _Write | None:
    item = decoded.header
    if decoded.values is None:
        return None
    raw_locations = None if decoded.locations is None else unpack_buffer(decoded.locations)
    indices = decode_locations(item, raw_locations)
    raw_values = unpack_buffer(decoded.values).view(unsigned_numpy_dtype(item.itemsize))
    values = _as_tensor(raw_values, device).view(int_dtype(item.dtype))
    if indices is None:
        return _Write(item, None, values)
    indices += item.span_start
    return _Write(item, _as_tensor(indices, device), values)


def _write(write: _Write, target: _FlatTarget, undo: UndoLog | None) -> None:
    item = write.item
    if write.indices is None and target.contiguous:
        start = item.span_start + item.first
        if undo is not None:
            old = read_range(target.flat, start, item.count)
            undo.add(UndoEntry(target.flat, old, start=start))
        write_range(target.flat, start, write.values)
        return
    if write.indices is None:
        start = item.span_start + item.first
        span_index = torch.arange(start, start + item.count, device=target.flat.device)
    else:
        span_index = write.indices
    positions = target.positions(span_index)
    if undo is not None:
        undo.add(UndoEntry(target.flat, gather(target.flat, positions), positions))
    scatter(target.flat, positions, write.values)


def apply_payload(
    payload: DecodedPayload | DeltaPayload | BytesLike | Sequence[BytesLike],
    tensors: Mapping[str, torch.Tensor],
    current: WeightVersion | None,
    *,
    undo: UndoLog | None = None,
) -> AppliedPayload:
    """Apply ``payload`` in place to ``tensors``, the receiver's tensors at version ``current``.

    Args:
        payload: a payload already verified by :func:`decode_payload`, a payload object, its
            joined bytes, or its frames.
        tensors: name -> tensor to update (any device; non-contiguous views are fine).
        current: the version the receiver holds (None: none yet, so only a resync applies).
        undo: if given, the overwritten bits are appended to it, so a caller can roll back
            (``undo.restore()``) or keep the update (``undo.discard()``); a failure while
            writing (after every check passed, e.g. a device out of memory) is then rolled
            back too. Without it such a failure can leave a partial update.

    Raises:
        ChecksumMismatchError: corrupted payload; nothing touched.
        ProtocolError: malformed payload; nothing touched.
        StaleBaseError: the payload was built against another version; nothing touched.
        GeometryMismatchError: a name, dtype or shape differs from the receiver's; nothing touched.
    """
    decoded = payload if isinstance(payload, DecodedPayload) else decode_payload(payload)
    for item in decoded.items:
        check_item(item.header, tensors, current)
    writes = [
        (write, tensors[item.header.name])
        for item in decoded.items
        if (write := _decode(item, tensors[item.header.name].device)) is not None
    ]
    targets: dict[str, _FlatTarget] = {}
    local = None if undo is None else UndoLog()
    try:
        for write, tensor in writes:
            if write.item.name not in targets:
                targets[write.item.name] = _FlatTarget(tensor)
            _write(write, targets[write.item.name], local)
    except BaseException:
        if local is not None:
            local.restore()
        raise
    if undo is not None and local is not None:
        undo.extend(local)
    touched = {item.header.name: tensors[item.header.name] for item in decoded.items}
    return AppliedPayload(tuple(item.header for item in decoded.items), touched, decoded.nbytes)
