"""Tensor handles that cross into an SGLang process: shared memory on CPU, CUDA IPC on GPU.

A payload is what SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``
produces: base64 of a ``ForkingPickler`` pickle of ``{"flattened_tensor", "metadata"}``. On
GPU, torch's own reduction turns the tensor into a CUDA IPC handle. On CPU the buffer lives in
a file under ``/dev/shm`` and pickles as its path, which any process on the host can map.
"""

from __future__ import annotations

import base64
import io
import logging
import mmap
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing

from refit_sglang.buckets import FlattenedBucket

__all__ = ["SharedBuffers", "attach_shared"]

logger = logging.getLogger(__name__)

_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def attach_shared(path: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Map the shared-memory buffer at ``path`` (runs in the receiving process).

    Raises:
        FileNotFoundError: the sender has released the buffer already (a late receiver).
    """
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    fd = os.open(path, os.O_RDWR)  # never creates: a released buffer stays gone
    try:
        mapping = mmap.mmap(fd, numel * dtype.itemsize)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


@dataclass(frozen=True)
class _SharedHandle:
    """Pickles as a call to :func:`attach_shared`, so the receiver gets a tensor."""

    path: str
    dtype: torch.dtype
    numel: int

    def __reduce__(self) -> tuple[object, tuple[str, torch.dtype, int]]:
        return attach_shared, (self.path, self.dtype, self.numel)


class SharedBuffers:
    """Allocates bucket buffers the engine can map, serializes them, releases them.

    Tracks the bytes alive now and at most (``live_bytes``, ``peak_bytes``) so tests and
    benchmarks can see that a buffer is released once the engine has consumed it.

    Args:
        device: where buffers live; CUDA buffers travel as CUDA IPC handles.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._held: dict[int, tuple[Path, torch.Tensor]] = {}
        """id(buffer) -> its file and the buffer (held, so the id cannot be reused)."""
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0

    def allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements the engine can map."""
        nbytes = numel * dtype.itemsize
        if self._device.type == "cpu":
            path = _SHM_DIR / f"refit-sglang-{os.getpid()}-{uuid.uuid4().hex}"
            with path.open("wb") as file:
                file.truncate(max(nbytes, 1))
            tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
            self._held[id(tensor)] = (path, tensor)
        else:
            tensor = torch.empty(numel, dtype=dtype, device=self._device)
        with self._lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return tensor

    def serialize(self, bucket: FlattenedBucket) -> str:
        """``bucket`` as SGLang's flattened-bucket payload string."""
        tensor = bucket.flattened_tensor
        held = self._held.get(id(tensor))
        flat: object = (
            tensor if held is None else _SharedHandle(str(held[0]), tensor.dtype, tensor.numel())
        )
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump({"flattened_tensor": flat, "metadata": list(bucket.metadata)})
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    def release(self, bucket: FlattenedBucket) -> None:
        """Forget ``bucket``'s buffer: its shared file is unlinked (the memory goes once the
        last mapping closes)."""
        held = self._held.pop(id(bucket.flattened_tensor), None)
        if held is not None:
            held[0].unlink(missing_ok=True)
        with self._lock:
            self.live_bytes -= bucket.nbytes

    def release_all(self) -> None:
        """Unlink every buffer still held (after a failed refit)."""
        for path, _ in self._held.values():
            path.unlink(missing_ok=True)
        self._held.clear()
        with self._lock:
            self.live_bytes = 0
