"""Pipelined broadcast of a :class:`TransferPlan`: pack bucket k+1 while bucket k is in flight.

Up to ``geometry.num_buffers`` buckets are in flight on each side. The sender packs into
reusable staging buffers and sends a solo bucket straight from the tensor's storage. The
receiver posts receives ahead and hands each bucket to its consumer as views: of a staging
buffer (the consumer must copy what it keeps before returning; a solo bucket arrives in a
fresh tensor), or, when it keeps its weights in a :class:`PlanStorage`, of that storage, which
every bucket is received straight into.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from refit_core import ProtocolError, RefitError
from refit_core.backend import Deadline
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.calls import PendingCall
from refit_nccl.group.tensors import wire_view
from refit_nccl.transfer.packing import check_tensor, pack_bucket, unpack_bucket
from refit_nccl.transfer.plan import PackedBucket, TransferPlan
from refit_nccl.transfer.stats import TransferStats
from refit_nccl.transfer.storage import PlanStorage, StagingBuffers

__all__ = ["Consumer", "receive_packed", "send_packed"]

logger = logging.getLogger(__name__)

Consumer = Callable[[list[tuple[str, torch.Tensor]]], None]
"""Takes one bucket's ``(name, tensor)`` pairs; the tensors are only valid during the call."""


def _buffer_count(plan: TransferPlan) -> int:
    packed = sum(1 for b in plan.buckets if not b.solo)
    return min(plan.geometry.num_buffers, packed)


def _drain(in_flight: deque[PendingCall]) -> None:
    """Wait out calls still in flight after a failure (each ends by its own deadline)."""
    while in_flight:
        try:
            in_flight.popleft().wait()
        except RefitError:
            logger.debug("in-flight call ended with an error after the first failure")


def _take(items: Iterator[tuple[str, torch.Tensor]], bucket: PackedBucket) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for slot in bucket.slots:
        item = next(items, None)
        if item is None:
            raise ProtocolError(f"source ended before {slot.name!r}")
        check_tensor(slot, *item)
        tensors.append(item[1])
    return tensors


def send_packed(
    group: AbortableProcessGroup,
    plan: TransferPlan,
    tensors: Iterable[tuple[str, torch.Tensor]],
    deadline: Deadline,
    *,
    root: int = 0,
    staging: StagingBuffers | None = None,
) -> TransferStats:
    """Broadcast ``tensors`` (in plan order) from this rank, ``root``, to every other rank.

    Raises:
        ProtocolError: the source does not yield exactly the plan's tensors; the group is
            aborted so receivers end by their deadline.
        RefitTimeoutError: a broadcast did not complete by the deadline or a peer failed.
    """
    started = time.perf_counter()
    buffers = (staging or StagingBuffers()).get(
        _buffer_count(plan), plan.buffer_bytes, group.device
    )
    free = list(range(len(buffers)))
    in_flight: deque[PendingCall] = deque()
    held: deque[tuple[int | None, torch.Tensor]] = deque()  # slot and bytes of each call
    items = iter(tensors)
    pack_s = wait_s = 0.0
    posted_bytes = 0  # handed to the communicator: what the failure's progress counts
    try:
        for bucket in plan.buckets:
            if len(in_flight) >= plan.geometry.num_buffers:
                mark = time.perf_counter()
                in_flight.popleft().wait()
                wait_s += time.perf_counter() - mark
                released, _ = held.popleft()
                if released is not None:
                    free.append(released)
            mark = time.perf_counter()
            batch = _take(items, bucket)
            slot: int | None = None
            if bucket.solo:
                source = batch[0].detach().resolve_conj().resolve_neg()
                wire = wire_view(source.to(group.device).contiguous())
            else:
                slot = free.pop()
                wire = buffers[slot][: bucket.nbytes]
                pack_bucket(bucket, batch, wire)
            pack_s += time.perf_counter() - mark
            in_flight.append(group.broadcast_async(wire, root, deadline))
            held.append((slot, wire))
            posted_bytes += wire.numel()
        if next(items, None) is not None:
            raise ProtocolError(f"source yields more than the plan's {plan.num_tensors} tensors")
        mark = time.perf_counter()
        while in_flight:
            in_flight.popleft().wait()
        wait_s += time.perf_counter() - mark
    except BaseException as exc:
        if isinstance(exc, RefitError):
            exc.progress = posted_bytes / max(1, plan.wire_bytes)
        group.abort(f"send failed: {exc}")
        _drain(in_flight)
        raise
    return TransferStats(
        len(plan.buckets),
        plan.wire_bytes,
        plan.dense_bytes,
        pack_s,
        0.0,
        wait_s,
        time.perf_counter() - started,
    )


def receive_packed(
    group: AbortableProcessGroup,
    plan: TransferPlan,
    consume: Consumer,
    deadline: Deadline,
    *,
    root: int = 0,
    staging: StagingBuffers | None = None,
    into: PlanStorage | None = None,
) -> TransferStats:
    """Receive every bucket of ``plan`` from ``root`` and hand each to ``consume``, in order.

    With ``into`` (storage laid out by this same plan) every bucket lands in place and the
    views handed to ``consume`` are the storage itself.

    Raises:
        ValueError: ``into`` was laid out by another plan.
        RefitTimeoutError: a broadcast did not complete by the deadline or a peer failed.
        Exception: whatever ``consume`` raised; the group is aborted.
    """
    if into is not None and into.plan.digest != plan.digest:
        raise ValueError("the storage was laid out by another plan")
    started = time.perf_counter()
    count = 0 if into is not None else _buffer_count(plan)
    buffers = (staging or StagingBuffers()).get(count, plan.buffer_bytes, group.device)
    free = list(range(len(buffers)))
    pending = iter(enumerate(plan.buckets))
    posted: deque[tuple[PackedBucket, torch.Tensor, int | None]] = deque()
    in_flight: deque[PendingCall] = deque()
    consume_s = wait_s = 0.0

    def post_ahead() -> None:
        while len(in_flight) < plan.geometry.num_buffers:
            index, bucket = next(pending, (0, None))
            if bucket is None:
                return
            slot: int | None = None
            if into is not None:
                data = wire = into.bucket(index)
            elif bucket.solo:
                spec = bucket.slots[0]
                data = torch.empty(spec.spec.shape, dtype=spec.dtype, device=group.device)
                wire = wire_view(data)
            else:
                slot = free.pop()
                data = wire = buffers[slot][: bucket.nbytes]
            in_flight.append(group.broadcast_async(wire, root, deadline))
            posted.append((bucket, data, slot))

    try:
        post_ahead()
        while in_flight:
            mark = time.perf_counter()
            in_flight.popleft().wait()
            wait_s += time.perf_counter() - mark
            bucket, data, slot = posted.popleft()
            mark = time.perf_counter()
            solo = bucket.solo and into is None
            consume([(bucket.slots[0].name, data)] if solo else unpack_bucket(bucket, data))
            consume_s += time.perf_counter() - mark
            if slot is not None:
                free.append(slot)
            post_ahead()
    except BaseException as exc:
        group.abort(f"receive failed: {exc}")
        _drain(in_flight)
        raise
    return TransferStats(
        len(plan.buckets),
        plan.wire_bytes,
        plan.dense_bytes,
        0.0,
        consume_s,
        wait_s,
        time.perf_counter() - started,
    )
