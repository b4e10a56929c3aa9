"""Phase ``references``: what the hardware moves, for every ratio of the check.

A device-to-device copy and pinned and pageable host copies (each the median of five rounds
timed by CUDA events), and a CUDA IPC read: a second process opens the buffer by its IPC
handle (torch's own sharing of a CUDA tensor with a spawned process) and copies it into its
own memory. Rates are bytes copied per second (a device copy reads and writes each byte).
"""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

import torch

from refit_lab.device_check.timing import GiB, cuda_gbps

__all__ = ["DEVICE_BYTES", "HOST_BYTES", "ipc_read_gbps", "run"]

DEVICE_BYTES = 4 * GiB
"""Device and pinned copies (several GiB, as a refit of a large model moves)."""
HOST_BYTES = 1 * GiB
"""Pageable copies (slow; fewer bytes keep the phase short)."""


def _read_by_handle(shared: torch.Tensor, rounds: int, out: Queue[float]) -> None:
    """Child: copy ``shared`` (opened by its CUDA IPC handle) into local memory; the rate."""
    torch.cuda.set_device(shared.device)
    local = torch.empty_like(shared)
    out.put(cuda_gbps(lambda: local.copy_(shared), shared.numel(), rounds=rounds))


def ipc_read_gbps(buffer: torch.Tensor, rounds: int = 5) -> float:
    """GB/s at which a second process copies ``buffer`` out of this one by CUDA IPC."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results: Queue[float] = context.Queue()
    child = context.Process(target=_read_by_handle, args=(buffer, rounds, results))
    child.start()
    try:
        rate = results.get(timeout=60)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return rate


def run() -> dict[str, Any]:
    """The reference rates, and the IPC read as a fraction of an in-process device copy."""
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.full((DEVICE_BYTES,), 7, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    pinned = torch.full((DEVICE_BYTES,), 3, dtype=torch.uint8).pin_memory()
    pageable = torch.full((HOST_BYTES,), 5, dtype=torch.uint8)
    head = target[:HOST_BYTES]
    rates = {
        "device_copy_gbps": cuda_gbps(lambda: target.copy_(source), DEVICE_BYTES),
        "h2d_pinned_gbps": cuda_gbps(lambda: target.copy_(pinned, non_blocking=True), DEVICE_BYTES),
        "d2h_pinned_gbps": cuda_gbps(lambda: pinned.copy_(source, non_blocking=True), DEVICE_BYTES),
        "h2d_pageable_gbps": cuda_gbps(lambda: head.copy_(pageable), HOST_BYTES, rounds=3),
        "d2h_pageable_gbps": cuda_gbps(
            lambda: pageable.copy_(source[:HOST_BYTES]), HOST_BYTES, rounds=3
        ),
        "cuda_ipc_read_gbps": ipc_read_gbps(source),
    }
    return {
        "ok": True,
        "device_bytes": DEVICE_BYTES,
        "host_bytes": HOST_BYTES,
        **rates,
        "cuda_ipc_read_vs_device_copy": rates["cuda_ipc_read_gbps"] / rates["device_copy_gbps"],
    }
