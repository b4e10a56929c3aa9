"""Phase ``collective``: refit's abortable NCCL group on one GPU.

A world of one connects (the communicator is created eagerly, bound to the device), broadcasts
and all-reduces 1 GiB, is aborted and refuses the next call. Then a world of two whose second
member joins the store but never creates its communicator: the first member's eager,
non-blocking NCCL init must end at its deadline through torch's communicator abort.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch

from refit_core import RefitAbortedError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_lab.device_check.timing import GiB, cuda_gbps
from refit_lab.ray_cluster import free_port
from refit_nccl.backend import AbortableProcessGroup, GroupSpec

__all__ = ["DEADLINE_S", "absent_peer", "run", "single_rank_group"]

DEADLINE_S = 3.0


def single_rank_group() -> dict[str, Any]:
    """A world of one: connect, broadcast and all-reduce 1 GiB, abort, a call after it."""
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1, "nccl", "check"))
    started = time.perf_counter()
    group.connect(Deadline.after(30))
    connect_s = time.perf_counter() - started
    data = torch.ones(GiB // 4, device=group.device)
    broadcast = cuda_gbps(lambda: group.broadcast(data, 0, Deadline.after(30)), GiB, rounds=3)
    group.all_reduce(data, Deadline.after(30))
    correct = bool(torch.all(data == 1).item())
    started = time.perf_counter()
    group.abort("device check")
    abort_s = time.perf_counter() - started
    try:
        group.broadcast(data, 0, Deadline.after(5))
        after_abort = "no error"
    except RefitAbortedError:
        after_abort = "RefitAbortedError"
    return {
        "connect_s": connect_s,
        "broadcast_gbps_world_1": broadcast,
        "all_reduce_correct": correct,
        "abort_s": abort_s,
        "call_after_abort": after_abort,
    }


def absent_peer() -> dict[str, Any]:
    """A world of two whose second member never creates its communicator: how the first
    member's connect ends, and how long after its deadline."""
    from torch._C._distributed_c10d import TCPStore

    port = free_port()
    peer: list[TCPStore] = []
    joiner = threading.Thread(
        target=lambda: peer.append(
            TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        )
    )
    joiner.start()
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", port, 0, 2, "nccl", "half"))
    started = time.monotonic()
    try:
        group.connect(Deadline.after(DEADLINE_S))
        error = "connected"
    except RefitTimeoutError:
        error = "RefitTimeoutError"
    elapsed = time.monotonic() - started
    joiner.join(30)
    return {
        "absent_peer_error": error,
        "absent_peer_released_after_deadline_s": elapsed - DEADLINE_S,
    }


def run() -> dict[str, Any]:
    """Both checks; ``ok`` when every expectation held."""
    result = {**single_rank_group(), **absent_peer()}
    result["ok"] = (
        result["all_reduce_correct"]
        and result["call_after_abort"] == "RefitAbortedError"
        and result["absent_peer_error"] == "RefitTimeoutError"
        and result["absent_peer_released_after_deadline_s"] <= 1.0
    )
    return result
