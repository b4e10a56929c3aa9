"""Receiver processes of the vLLM-rendezvous test: vLLM's own group and packed consumer.

Each receiver joins refit's trainer the way vLLM 0.32.0 builds a stateless group
(``vllm.distributed.utils.stateless_init_torch_distributed_process_group``, gloo), issues the
one-element zero all-reduce that ``PyNcclCommunicator`` issues after it joins, then receives
through vLLM's own ``packed_nccl_broadcast_consumer``
(``vllm/distributed/weight_transfer/packed_tensor.py``). That consumer is written for CUDA: it
pins each buffer to a CUDA stream. Here the streams are stand-ins that do nothing and the
group is a gloo process group behind the consumer's ``broadcast(tensor, src)`` call; the
bucket boundaries, receive buffers and unpacking are vLLM's own code.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

MiB = 1024 * 1024
BUFFER_BYTES = MiB  # refit_core.CollectiveSenderSpec allows no less
NUM_BUFFERS = 2


def peer_state(seed: int) -> dict[str, torch.Tensor]:
    """A state vLLM's back-to-back packing keeps aligned (wider dtypes first): odd sizes,
    non-contiguous views and a tensor larger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.f32": torch.randn(301, 17, generator=g),
        "huge.f32": torch.randn(BUFFER_BYTES // 4 + 999, generator=g),
        "transposed.f32": torch.randn(64, 48, generator=g).t(),
        "idx.i64": torch.randint(-(2**40), 2**40, (5, 3), generator=g).to(torch.int64),
        **{
            f"layers.{i}.weight": torch.randn(256, 513, generator=g).to(torch.bfloat16)
            for i in range(12)
        },
        "strided.bf16": torch.randn(50, 40, generator=g).to(torch.bfloat16)[::2, 1::3],
        "odd.f16": torch.randn(3, 333, generator=g).to(torch.float16),
        "odd.u8": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "mask.bool": torch.rand(11, generator=g) > 0.5,
    }


class _NoStream:
    def synchronize(self) -> None:
        """CPU work is synchronous."""


class _GlooBroadcast:
    """The consumer's ``group.broadcast(tensor, src=...)`` over a gloo process group; records
    each bucket's size."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self.sizes: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.sizes.append(tensor.numel())
        self._pg.broadcast(tensor, src).wait()


@contextlib.contextmanager
def _cpu_streams(packed_tensor: Any) -> Iterator[None]:
    """vLLM's CUDA stream calls as no-ops, for the consumer to run on CPU."""
    saved = packed_tensor._get_streams, torch.cuda.stream, torch.accelerator.current_device_index
    packed_tensor._get_streams = lambda index, count: tuple(_NoStream() for _ in range(count))
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        (
            packed_tensor._get_streams,
            torch.cuda.stream,
            torch.accelerator.current_device_index,
        ) = saved  # type: ignore[assignment]


def vllm_receiver(results: Any, host: str, port: int, rank: int, world: int, seed: int) -> None:
    """Join as vLLM does, warm up, receive one packed transfer, report, then stay idle (a
    member that never joins the next transfer)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.distributed.weight_transfer import packed_tensor

    torch.set_num_threads(1)
    pg = stateless_init_torch_distributed_process_group(
        host, port, rank, world, "gloo", timeout=timedelta(seconds=120)
    )
    warm_up = torch.zeros(1)
    pg.allreduce([warm_up]).wait()
    results.put({"rank": rank, "event": "joined", "warm_up": warm_up.item()})

    expected = peer_state(seed)
    received: dict[str, torch.Tensor] = {}

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            received[name] = tensor.clone()

    metadata = ((n, (list(t.shape), t.dtype)) for n, t in expected.items())
    group = _GlooBroadcast(pg)
    with _cpu_streams(packed_tensor):
        packed_tensor.packed_nccl_broadcast_consumer(
            iterator=metadata,
            group=group,
            src=0,
            post_unpack_func=load,
            buffer_size_bytes=BUFFER_BYTES,
            num_buffers=NUM_BUFFERS,
            device="cpu",
        )
    wrong = [
        name
        for name, tensor in expected.items()
        if name not in received
        or received[name].dtype != tensor.dtype
        or received[name].shape != tensor.shape
        or not torch.equal(
            received[name].reshape(-1).view(torch.uint8),
            tensor.contiguous().reshape(-1).view(torch.uint8),
        )
    ]
    results.put({"rank": rank, "event": "received", "wrong": wrong, "sizes": group.sizes})
    time.sleep(600)


def check_a_transfer_nobody_joins_ends_by_the_deadline(trainer: Any, deadline_s: float) -> None:
    """``trainer.refit_transfer`` with no receiver taking part raises ``RefitTimeoutError`` by
    ``deadline_s`` + 1 s, and the aborted group refuses the next transfer."""
    import pytest

    from refit_core import RefitAbortedError, RefitTimeoutError

    started = time.monotonic()
    with pytest.raises(RefitTimeoutError):
        trainer.refit_transfer(2, deadline_s)
    assert time.monotonic() - started <= deadline_s + 1.0
    with pytest.raises(RefitAbortedError):
        trainer.refit_transfer(3, 5.0)
