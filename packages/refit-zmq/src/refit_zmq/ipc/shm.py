"""CPU shared memory that an unrelated process of the same user can map: a ``memfd``.

The sender creates an anonymous memory file (``os.memfd_create``) and keeps its descriptor
open; a receiver opens ``/proc/<pid>/fd/<fd>`` and maps it. Why this and not the
alternatives: ``Tensor.share_memory_()`` pickles as a file descriptor that only travels
through multiprocessing's own fd-passing socket, and a named ``/dev/shm`` file outlives a
sender killed with SIGKILL. A memfd is freed when the sender and the last mapping are gone,
and opening it through ``/proc`` needs the kernel's ptrace read check, so only processes of
the same user (or root) can map it. The receiver checks the inode and size it was told, so a
recycled pid or descriptor number is refused rather than mapped. Linux only.
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from refit_core import ProtocolError

__all__ = ["ShmBuffer", "ShmHandle", "attach_shm"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShmHandle:
    """Where a receiver finds a sender's memfd, and what it must look like."""

    pid: int
    fd: int
    inode: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """The handle as a JSON object (``kind`` ``"shm"``)."""
        return {
            "kind": "shm",
            "pid": self.pid,
            "fd": self.fd,
            "inode": self.inode,
            "nbytes": self.nbytes,
        }


class ShmBuffer:
    """A sender-owned memfd of ``nbytes``, mapped read-write as a 1-D uint8 tensor.

    Pages are allocated when first written, so an unused tail costs no memory.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        self._fd: int | None = os.memfd_create("refit-ipc", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            mapping = mmap.mmap(self._fd, nbytes)
        except BaseException:
            os.close(self._fd)
            raise
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self.handle = ShmHandle(os.getpid(), self._fd, os.fstat(self._fd).st_ino, nbytes)

    def close(self) -> None:
        """Close the descriptor (idempotent); the memory goes with the last mapping."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def attach_shm(handle: ShmHandle) -> torch.Tensor:
    """Map a sender's memfd read-only (in the receiving process) as a 1-D uint8 tensor.

    Raises:
        ProtocolError: the sender or its descriptor is gone, or the file is not the one named.
    """
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ProtocolError(f"cannot open shared buffer {path}: {exc}") from exc
    try:
        stat = os.fstat(fd)
        if stat.st_ino != handle.inode or stat.st_size != handle.nbytes:
            raise ProtocolError(
                f"{path} is not the buffer named (inode {stat.st_ino}, {stat.st_size} bytes)"
            )
        mapping = mmap.mmap(fd, handle.nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)
