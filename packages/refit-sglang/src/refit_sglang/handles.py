"""Tensor handles that cross into an SGLang process: shared memory on CPU, CUDA IPC on GPU.

A payload is what SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``
produces: base64 of a ``ForkingPickler`` pickle of ``{"flattened_tensor", "metadata"}``, and
SGLang reads it back with its ``SafeUnpickler``, which admits builtins, a few standard types
and torch's own rebuild functions, and refuses every class of a code module. So a payload
holds nothing else:

- ``metadata``: one ``types.SimpleNamespace`` per tensor with the attributes of SGLang's
  ``FlattenedTensorMetadata`` (name, shape, dtype, start_idx, end_idx, numel), which SGLang's
  ``WeightUpdater`` reads attribute by attribute;
- on GPU, the tensor through torch's CUDA IPC reduction (``rebuild_cuda_tensor``), its device
  named by UUID, as SGLang's own producers name it (``monkey_patch_torch_reductions``), so a
  receiver whose ``CUDA_VISIBLE_DEVICES`` numbers the GPUs otherwise maps the right one;
- on CPU, the buffer in shared memory named by torch's file-system strategy
  (``rebuild_storage_filename``), which any process on the host can map.

Each serialization is one receiver's reference (torch counts them: CUDA IPC ref counters, the
shared segment's refcount), so a payload is made per tensor-parallel rank and each rank
unpickles only its own, as SGLang's ``Engine._serialize_tensors_per_rank`` does.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from refit_sglang.buckets import FlattenedBucket

__all__ = ["SharedBuffers", "serialize_bucket"]

logger = logging.getLogger(__name__)

_DEVICE_ARG = 6
"""Where ``rebuild_cuda_tensor``'s arguments carry the storage's device (SGLang rewrites the
same position to a UUID)."""


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """A CPU storage as torch's file-system strategy pickles it: by shared-memory name."""
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # type: ignore[no-untyped-call]  # the receiver drops it again
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _reduce_tensor_by_uuid(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's tensor reduction; a CUDA tensor's device index becomes the GPU's UUID.

    torch's own reduction is used even where SGLang has patched it in this process (an
    in-process engine): SGLang's patch assumes a CUDA tensor and fails on a CPU one.
    """
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    rebuild, args = reduce(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def serialize_bucket(bucket: FlattenedBucket) -> str:
    """``bucket`` as one SGLang flattened-bucket payload string (one receiver's reference)."""
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_name
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_by_uuid
    metadata = [SimpleNamespace(**vars(slot)) for slot in bucket.metadata]
    pickler.dump({"flattened_tensor": bucket.flattened_tensor, "metadata": metadata})
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SharedBuffers:
    """Allocates bucket buffers the engine can map, serializes them, releases them.

    Tracks the bytes alive now and at most (``live_bytes``, ``peak_bytes``) so tests and
    benchmarks can see that a buffer is released once the engine has consumed it. A CPU
    buffer is a shared-memory segment of torch's file-system strategy: it is freed when this
    process and every receiver have dropped it (a payload no receiver ever unpickled holds
    it until this process exits, when torch's shared-memory manager removes it).

    Args:
        device: where buffers live; CUDA buffers travel as CUDA IPC handles.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._held: dict[int, torch.Tensor] = {}
        """id(buffer) -> the buffer, until released (held, so the id cannot be reused)."""
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0

    def allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements the engine can map."""
        nbytes = numel * dtype.itemsize
        if self._device.type == "cpu":
            storage = torch.UntypedStorage._new_using_filename_cpu(max(nbytes, 1))
            tensor = torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
        else:
            tensor = torch.empty(numel, dtype=dtype, device=self._device)
        with self._lock:
            self._held[id(tensor)] = tensor
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return tensor

    def serialize(self, bucket: FlattenedBucket, copies: int = 1) -> list[str]:
        """``copies`` payload strings of ``bucket``, each one receiver's own reference."""
        return [serialize_bucket(bucket) for _ in range(copies)]

    def release(self, bucket: FlattenedBucket) -> None:
        """Forget ``bucket``'s buffer (its memory goes once every receiver dropped it too)."""
        with self._lock:
            if self._held.pop(id(bucket.flattened_tensor), None) is not None:
                self.live_bytes -= bucket.nbytes

    def release_all(self) -> None:
        """Forget every buffer still held (after a failed refit)."""
        with self._lock:
            self._held.clear()
            self.live_bytes = 0
