"""Shared-memory byte buffers the parent and the communicator's child both map."""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import uuid
from collections.abc import Callable

import torch

__all__ = ["SharedBuffers"]


def _shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedBuffers:
    """Shared-memory byte buffers known to the child, reused across calls.

    Each is a file both processes map; the parent unlinks it once a call that used it has
    ended (the child mapped it when it registered it), or at :meth:`clear`.

    Args:
        register: tells the child about a new buffer: ``(id, path, size)``.
    """

    def __init__(self, register: Callable[[int, str, int], None]) -> None:
        self._register = register
        self._free: list[tuple[int, torch.Tensor]] = []
        self._ids: dict[int, int] = {}  # data_ptr -> id
        self._paths: dict[int, str] = {}  # id -> file not yet unlinked
        self._count = itertools.count()
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free buffer of at least ``nbytes`` (a new one, registered, if none fits)."""
        with self._lock:
            fits = [entry for entry in self._free if entry[1].numel() >= nbytes]
            if fits:
                entry = min(fits, key=lambda e: e[1].numel())
                self._free.remove(entry)
                return entry
            index = next(self._count)
            path = os.path.join(_shared_dir(), f"refit-child-{uuid.uuid4().hex}")
            size = max(nbytes, 1)
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._ids[buffer.data_ptr()] = index
            self._paths[index] = path
        self._register(index, path, size)
        return index, buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back for reuse once its call ended (unlinks its file)."""
        with self._lock:
            index = self._ids.get(buffer.data_ptr())
            if index is None:  # cleared by an abort
                return
            self._free.append((index, buffer))
            path = self._paths.pop(index, None)
        if path is not None:
            _unlink(path)

    def clear(self) -> None:
        """Forget every buffer and unlink the files not unlinked yet."""
        with self._lock:
            paths = list(self._paths.values())
            self._free.clear()
            self._ids.clear()
            self._paths.clear()
        for path in paths:
            _unlink(path)
