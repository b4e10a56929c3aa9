"""Timing on a CUDA device: each round between two CUDA events, the median of the rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["GiB", "cuda_gbps", "cuda_seconds"]

GiB = 1 << 30


def cuda_seconds(fn: Callable[[], object], *, rounds: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``rounds`` calls of ``fn`` on the current stream (after ``warmup``
    untimed calls), each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples: list[float] = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return samples


def cuda_gbps(fn: Callable[[], object], nbytes: int, *, rounds: int = 5) -> float:
    """``nbytes`` over the median of :func:`cuda_seconds`, in GB/s (1e9 bytes)."""
    return nbytes / statistics.median(cuda_seconds(fn, rounds=rounds)) / 1e9
