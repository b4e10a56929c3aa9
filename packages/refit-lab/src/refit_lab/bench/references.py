"""Reference transfers every bench compares against; each returns a measured rate in GB/s.

Each reference moves the same bytes with the same torch threads as the code under test, so a
weakened reference shows up as a low rate rather than a flattering ratio.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from refit_lab.bench.harness import TimingStats, gbps
from refit_lab.bench.raw_zmq import ZmqStream, zmq_stream
from refit_lab.bench.runtime import ChildGroup, Deadline, torch_threads

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed import Work

__all__ = [
    "Memcpy",
    "MiB",
    "ZmqStream",
    "gloo_broadcast_gbps",
    "memcpy_gbps",
    "nemo_apply",
    "nemo_encode",
    "numpy_delta_apply",
    "numpy_delta_encode",
    "xor_zstd_apply",
    "xor_zstd_encode",
    "zmq_stream",
]

logger = logging.getLogger(__name__)

MiB = 1 << 20
_FILL = 0xA5
_CHECK_STRIDE = 4099


class Memcpy:
    """`torch` `copy_` of a contiguous uint8 buffer into a preallocated one, with `threads`,
    on `device` (a GPU: a device-to-device copy); both buffers are touched before any timing.
    Keep one across interleaved rounds so every round pays for one copy and nothing else."""

    def __init__(self, nbytes: int, *, threads: int, device: str = "cpu") -> None:
        import torch

        self.nbytes = nbytes
        self._threads = threads
        self._device = device
        self._src = torch.full((nbytes,), _FILL, dtype=torch.uint8, device=device)
        self._dst = torch.zeros_like(self._src)
        self.seconds()

    def seconds(self) -> float:
        """Time one copy (a GPU copy to its completion)."""
        import torch

        with torch_threads(self._threads):
            started = time.perf_counter()
            self._dst.copy_(self._src)
            if self._device != "cpu":
                torch.cuda.synchronize(self._device)
            return time.perf_counter() - started


def memcpy_gbps(nbytes: int, *, repeats: int, threads: int) -> float:
    """:class:`Memcpy` of `nbytes`: the median rate of `repeats` copies after a warm-up."""
    copy = Memcpy(nbytes, threads=threads)
    rate = gbps(nbytes, TimingStats.from_samples([copy.seconds() for _ in range(repeats)]).median_s)
    logger.info("memcpy %d bytes: %.3f GB/s (median of %d)", nbytes, rate, repeats)
    return rate


class _GlooGroup(Protocol):
    """The collectives of `ProcessGroupGloo` used here (torch's stubs type them on ProcessGroup)."""

    def allreduce(self, tensors: list[torch.Tensor], *, timeout: datetime.timedelta) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Work: ...


def _tcp_store(port: int, *, is_master: bool, timeout: datetime.timedelta) -> TCPStore:
    """A `TCPStore` on 127.0.0.1 that does not wait for workers (port 0: an ephemeral one)."""
    import torch.distributed as dist

    store: TCPStore = dist.TCPStore(  # type: ignore[attr-defined]  # not re-exported in torch's stubs
        "127.0.0.1", port, is_master=is_master, timeout=timeout, wait_for_workers=False
    )
    return store


def _gloo_rank(
    rank: int,
    world_size: int,
    port: int,
    nbytes: int,
    rounds: int,
    threads: int,
    timeout_s: float,
) -> list[float]:
    """One rank of the gloo reference: `rounds` broadcasts of `nbytes` from rank 0, timed."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    deadline = Deadline(timeout_s, f"gloo rank {rank}")
    store = _tcp_store(port, is_master=False, timeout=deadline.remaining())
    group = cast(_GlooGroup, dist.ProcessGroupGloo(store, rank, world_size, deadline.remaining()))
    buf = torch.full((nbytes,), _FILL if rank == 0 else 0, dtype=torch.uint8)
    token = torch.zeros(1)
    times: list[float] = []
    for _ in range(rounds):
        group.allreduce([token], timeout=deadline.remaining()).wait(deadline.remaining())
        start = time.perf_counter()
        group.broadcast(buf, 0, deadline.remaining()).wait(deadline.remaining())
        times.append(time.perf_counter() - start)
    if not bool((buf[::_CHECK_STRIDE] == _FILL).all()):
        raise RuntimeError(f"gloo rank {rank}: broadcast delivered wrong bytes")
    return times


def gloo_broadcast_gbps(
    nbytes: int,
    *,
    repeats: int,
    threads: int,
    world_size: int = 2,
    timeout_s: float | None = None,
) -> float:
    """One flat gloo broadcast of `nbytes` from rank 0 across `world_size` child processes.

    The group is a `ProcessGroupGloo` over a `TCPStore` hosted here on an ephemeral port (no
    default world). Each round starts after an all-reduce barrier; its time is the slowest rank's.
    """
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2, got {world_size}")
    rounds = repeats + 1
    deadline = Deadline(
        timeout_s or 60.0 + nbytes * rounds * (world_size - 1) / 50e6, "gloo reference"
    )
    store = _tcp_store(0, is_master=True, timeout=deadline.remaining())
    args = [
        (rank, world_size, store.port, nbytes, rounds, threads, deadline.remaining_s())
        for rank in range(world_size)
    ]
    with ChildGroup(_gloo_rank, args, deadline=deadline, name="gloo-rank") as ranks:
        per_rank = ranks.results()
    slowest = [max(round_times) for round_times in zip(*per_rank, strict=True)][1:]
    rate = gbps(nbytes, TimingStats.from_samples(slowest).median_s)
    logger.info(
        "gloo broadcast %d bytes to %d ranks: %.3f GB/s (median of %d)",
        nbytes,
        world_size,
        rate,
        repeats,
    )
    return rate


def _recipe_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as a flat integer tensor of the same width (no copy)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(width[tensor.element_size()]).view(-1)


def xor_zstd_encode(
    old: torch.Tensor, new: torch.Tensor, *, out: torch.Tensor | None = None
) -> tuple[bytes, bytes]:
    """The slime/SkyRL recipe for one contiguous tensor: (payload, digest).

    XOR of the whole tensor's bits (torch, into ``out``, a uint8 scratch of at least the
    tensor's bytes, when given, so no page faults are timed), zstd level 1 of the XOR,
    xxh3-128 of the compressed bytes.
    """
    import torch
    import xxhash
    import zstandard

    old_bits, new_bits = _recipe_bits(old), _recipe_bits(new)
    scratch = None if out is None else out.view(new_bits.dtype)[: new_bits.numel()]
    delta = torch.bitwise_xor(new_bits, old_bits, out=scratch)
    payload: bytes = zstandard.ZstdCompressor(level=1).compress(delta.numpy().data)
    return payload, xxhash.xxh3_128_digest(payload)


def xor_zstd_apply(payload: bytes, digest: bytes, target: torch.Tensor) -> None:
    """Verify the xxh3-128, decompress, and XOR the delta into ``target`` in place."""
    import numpy
    import torch
    import xxhash
    import zstandard

    if xxhash.xxh3_128_digest(payload) != digest:
        raise ValueError("xor+zstd recipe: checksum mismatch")
    bits = _recipe_bits(target)
    raw = zstandard.ZstdDecompressor().decompress(payload)
    delta = torch.from_numpy(numpy.frombuffer(raw, dtype=bits.numpy().dtype).copy())
    bits.bitwise_xor_(delta)


def nemo_encode(old: torch.Tensor, new: torch.Tensor) -> tuple[bytes, bytes]:
    """The NeMo-RL recipe for one contiguous tensor: (payload, digest).

    Changed positions by a torch compare and ``nonzero``, gap-encoded as int32, with the new
    values, serialized with ``torch.save``, zstd level 1, BLAKE2b-128 of the compressed bytes.
    """
    import hashlib
    import io

    import torch
    import zstandard

    old_bits, new_bits = _recipe_bits(old), _recipe_bits(new)
    index = torch.nonzero(new_bits != old_bits).view(-1)
    gaps = torch.diff(index, prepend=index.new_zeros(1)).to(torch.int32)
    buffer = io.BytesIO()
    torch.save({"gaps": gaps, "values": new_bits[index]}, buffer)
    payload: bytes = zstandard.ZstdCompressor(level=1).compress(buffer.getbuffer())
    return payload, hashlib.blake2b(payload, digest_size=16).digest()


def nemo_apply(payload: bytes, digest: bytes, target: torch.Tensor) -> None:
    """Verify the BLAKE2b-128, decompress, ``torch.load`` and scatter into ``target``."""
    import hashlib
    import io

    import torch
    import zstandard

    if hashlib.blake2b(payload, digest_size=16).digest() != digest:
        raise ValueError("nemo recipe: checksum mismatch")
    raw = zstandard.ZstdDecompressor().decompress(payload)
    loaded = torch.load(io.BytesIO(raw), weights_only=True)
    index = torch.cumsum(loaded["gaps"].to(torch.int64), 0)
    _recipe_bits(target).index_copy_(0, index, loaded["values"])


def numpy_delta_encode(old: torch.Tensor, new: torch.Tensor) -> tuple[bytes, bytes]:
    """The straightforward numpy delta issue 3 calibrates against: (payload, digest).

    Whole-tensor compare of the bits, ``flatnonzero``, gather of the new values, ``diff`` of
    the indices as uint32 gaps, zstd level 1 of count, gaps and values, xxh3-128.
    """
    import xxhash
    import zstandard

    old_bits, new_bits = _recipe_bits(old).numpy(), _recipe_bits(new).numpy()
    index = np.flatnonzero(old_bits != new_bits)
    gaps = np.diff(index, prepend=0).astype(np.uint32)
    body = b"".join((index.size.to_bytes(8, "little"), gaps.tobytes(), new_bits[index].tobytes()))
    payload: bytes = zstandard.ZstdCompressor(level=1).compress(body)
    return payload, xxhash.xxh3_128_digest(payload)


def numpy_delta_apply(payload: bytes, digest: bytes, target: torch.Tensor) -> None:
    """Verify, decompress, rebuild the indices with ``cumsum`` and scatter into ``target``."""
    import xxhash
    import zstandard

    if xxhash.xxh3_128_digest(payload) != digest:
        raise ValueError("numpy delta: checksum mismatch")
    body = zstandard.ZstdDecompressor().decompress(payload)
    count = int.from_bytes(body[:8], "little")
    bits = _recipe_bits(target).numpy()
    gaps = np.frombuffer(body, dtype=np.uint32, count=count, offset=8)
    values = np.frombuffer(body, dtype=bits.dtype, count=count, offset=8 + 4 * count)
    bits[np.cumsum(gaps, dtype=np.int64)] = values
