"""Buffer geometry: slot alignment and the default size of the two ping-pong buffers.

With ``refit_buffer_size_gb`` unset, each of the two buffers gets
:data:`FREE_MEMORY_RATIO` of the memory free where it lives (the GPU's free memory from
``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of ``/proc/meminfo`` on CPU), capped at
:data:`MAX_DEFAULT_BUFFER_BYTES` on a GPU (vLLM's packed transfer also uses 1 GiB x 2) and
:data:`MAX_DEFAULT_HOST_BUFFER_BYTES` on CPU, never under :data:`MIN_BUFFER_BYTES`; so the
pair takes at most 10 % of the free memory.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "ALIGN_BYTES",
    "FREE_MEMORY_RATIO",
    "MAX_DEFAULT_BUFFER_BYTES",
    "MAX_DEFAULT_HOST_BUFFER_BYTES",
    "MIN_BUFFER_BYTES",
    "align_up",
    "default_buffer_bytes",
    "free_memory_bytes",
]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256
"""Every tensor starts at a multiple of this offset in its buffer (any dtype's alignment)."""

FREE_MEMORY_RATIO = 0.05
"""Share of the free memory each of the two buffers takes by default."""

MAX_DEFAULT_BUFFER_BYTES = 1 << 30
MAX_DEFAULT_HOST_BUFFER_BYTES = 64 << 20
"""On CPU the buffers are shared memory that the trainer and every worker keep mapped (each
process's resident memory counts the pages it touched: two 1 GiB buffers cost a 1 GB model's
worker its size again beside its staged copy), and copies gain nothing from buckets past a few
MiB."""
MIN_BUFFER_BYTES = 1 << 20


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where ``device``'s buffers live (GPU free memory, or ``MemAvailable``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable missing from /proc/meminfo")


def default_buffer_bytes(device: torch.device) -> int:
    """The size of one ping-pong buffer when none is configured (see the module docstring)."""
    share = int(free_memory_bytes(device) * FREE_MEMORY_RATIO)
    cap = MAX_DEFAULT_BUFFER_BYTES if device.type == "cuda" else MAX_DEFAULT_HOST_BUFFER_BYTES
    size = max(MIN_BUFFER_BYTES, min(cap, share))
    size -= size % ALIGN_BYTES
    logger.debug("default IPC buffer on %s: %d bytes", device, size)
    return size
