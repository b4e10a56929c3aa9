"""Timing on a CUDA device: each round between two CUDA events, the median of the rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["GiB", "Interleaved", "cuda_gbps", "cuda_seconds", "interleaved_with_device_copy"]

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


@dataclass(frozen=True)
class Interleaved:
    """A subject timed in rounds interleaved with its reference.

    Attributes:
        subject_gbps: the subject's median rate.
        reference_gbps: the reference's median rate.
        ratio: the median of the per-round ratios of the two.
    """

    subject_gbps: float
    reference_gbps: float
    ratio: float


def interleaved_with_device_copy(
    subject: Callable[[], object], nbytes: int, rounds: int, prepare: Callable[[], object]
) -> Interleaved:
    """Each round: ``prepare()``, a device-to-device copy of ``nbytes`` (the reference), then
    ``subject()`` on the wall clock between two device synchronizations; ``nbytes`` over each."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    subject_rates: list[float] = []
    reference_rates: list[float] = []
    for _ in range(rounds):
        prepare()
        reference_rates.append(cuda_gbps(lambda: target.copy_(source), nbytes))
        torch.cuda.synchronize()
        started = time.perf_counter()
        subject()
        torch.cuda.synchronize()
        subject_rates.append(nbytes / (time.perf_counter() - started) / 1e9)
    return Interleaved(
        statistics.median(subject_rates),
        statistics.median(reference_rates),
        statistics.median(s / r for s, r in zip(subject_rates, reference_rates, strict=True)),
    )
