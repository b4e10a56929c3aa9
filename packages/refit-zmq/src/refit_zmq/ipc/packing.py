"""Trainer side: the two ping-pong buffers and the packer that fills them, slot by slot.

Tensors are copied, in the source's order, into aligned slots of a free buffer; a bucket is
handed out when the next tensor does not fit. A tensor larger than half a buffer gets a
one-off buffer of its own (released once every worker acknowledged it). Every tensor is
checked against the manifest before it is copied, so a source that breaks its own
``state_dict_info`` raises instead of sending a wrong tensor.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import GeometryMismatchError, NamedTensor, TensorSpec
from refit_zmq.ipc.handles import SharedBuffer
from refit_zmq.ipc.protocol import Item, Op, slot_bytes
from refit_zmq.ipc.sizing import ALIGN_BYTES, align_up

__all__ = ["Bucket", "BufferPool", "Packer"]

logger = logging.getLogger(__name__)


class BufferPool:
    """The two ping-pong buffers and which of them are free to fill."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes < 2 * ALIGN_BYTES or nbytes % ALIGN_BYTES:
            raise ValueError(
                f"buffer size must be a multiple of {ALIGN_BYTES} >= 512, got {nbytes}"
            )
        self.nbytes = nbytes
        self.device = device
        self.buffers = [SharedBuffer(nbytes, device) for _ in range(2)]
        self._free: deque[int] = deque(range(len(self.buffers)))

    def acquire(self) -> int:
        """A free buffer's index; the caller fills it and releases it once acknowledged."""
        if not self._free:
            raise RuntimeError("both IPC buffers are in flight")
        return self._free.popleft()

    def release(self, index: int) -> None:
        """Mark a buffer free again."""
        if index not in self._free:
            self._free.append(index)

    def release_all(self) -> None:
        """Mark every buffer free (after a refit ended, whatever its outcome)."""
        self._free = deque(range(len(self.buffers)))

    def close(self) -> None:
        """Release the buffers."""
        for buffer in self.buffers:
            buffer.close()


@dataclass
class Bucket:
    """One filled memory region: a pool buffer (``buffer``) or a one-off buffer."""

    seq: int
    buffer: int | None
    oneoff: SharedBuffer | None = None
    items: list[Item] = field(default_factory=list)
    nbytes: int = 0

    def message(self, version: int) -> dict[str, Any]:
        """The ``bucket`` request announcing this memory."""
        message: dict[str, Any] = {
            "op": Op.BUCKET,
            "version": version,
            "seq": self.seq,
            "items": [item.to_json() for item in self.items],
        }
        if self.oneoff is not None:
            message["oneoff"] = self.oneoff.handle.to_json()
        else:
            message["buffer"] = self.buffer
        return message


def _copy_into(memory: torch.Tensor, offset: int, spec: TensorSpec, tensor: torch.Tensor) -> None:
    region = memory[offset : offset + slot_bytes(spec)]
    region.view(tensor.dtype).view(spec.shape).copy_(tensor)


class Packer:
    """Fills buckets from a source's tensors, checking each against ``manifest``."""

    def __init__(self, manifest: Mapping[str, TensorSpec], pool: BufferPool) -> None:
        self._manifest = manifest
        self._pool = pool

    def _check(self, named: NamedTensor, seen: set[str]) -> TensorSpec:
        expected = self._manifest.get(named.name)
        if expected is None:
            raise GeometryMismatchError(f"the source yielded {named.name!r}, not in its manifest")
        if named.name in seen:
            raise GeometryMismatchError(f"the source yielded {named.name!r} twice")
        actual = TensorSpec.of(named.tensor)
        if actual != expected:
            raise GeometryMismatchError(f"{named.name!r} is {actual}, its manifest says {expected}")
        seen.add(named.name)
        return actual

    def buckets(self, tensors: Iterable[NamedTensor]) -> Iterator[Bucket]:
        """Yield filled buckets; the consumer releases each pool buffer before the next but
        one bucket is asked for (two buffers: one in flight, one filling)."""
        seen: set[str] = set()
        seq = 0
        current: Bucket | None = None
        offset = 0
        half = self._pool.nbytes // 2
        for named in tensors:
            spec = self._check(named, seen)
            nbytes = slot_bytes(spec)
            if current is not None and (nbytes > half or offset + nbytes > self._pool.nbytes):
                yield current
                seq, current = seq + 1, None
            if nbytes > half:
                logger.debug("ipc: one-off buffer of %d bytes for %s", nbytes, named.name)
                oneoff = SharedBuffer(align_up(nbytes), self._pool.device)
                _copy_into(oneoff.tensor, 0, spec, named.tensor)
                yield Bucket(seq, None, oneoff, [Item(named.name, 0, spec)], nbytes)
                seq += 1
                continue
            if current is None:
                current, offset = Bucket(seq, self._pool.acquire()), 0
            assert current.buffer is not None
            _copy_into(self._pool.buffers[current.buffer].tensor, offset, spec, named.tensor)
            current.items.append(Item(named.name, offset, spec))
            current.nbytes += nbytes
            offset = align_up(offset + nbytes)
        if current is not None:
            yield current
        missing = sorted(set(self._manifest) - seen)
        if missing:
            raise GeometryMismatchError(
                f"the source never yielded {len(missing)} tensors: {missing[:5]}"
            )
