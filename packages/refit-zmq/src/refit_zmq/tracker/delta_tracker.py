"""The producer side of sparse refits: the last committed bits, and payloads against them."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Self

import numpy as np
import torch

from refit_core import GeometryMismatchError, NamedTensor, StateDictInfo, TensorSpec, WeightVersion
from refit_zmq.codec.diff import prepare_kernel
from refit_zmq.codec.dtypes import int_view
from refit_zmq.codec.format import DeltaPayload
from refit_zmq.codec.spans import read_span
from refit_zmq.tracker.encoder import BucketEncoder, DeviceBits, HostBits, PendingWrite
from refit_zmq.tracker.plan import ItemSpan, shard_items
from refit_zmq.tracker.store import BaselineStore, DeviceBaselines

__all__ = ["DeltaCompressionTracker", "TrackerConfig", "TrackerTraffic"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20


@dataclass(frozen=True)
class TrackerConfig:
    """How a tracker splits, buckets, stores and codes.

    Every producer of one refit must use the same ``shard_count`` and ``max_item_bytes`` (the
    shard plan depends on them).

    Attributes:
        shard_rank: this producer's shard.
        shard_count: how many producers share the state dict.
        bucket_size_bytes: dense input bytes per payload at most (one item may be larger
            only if ``max_item_bytes`` is).
        max_item_bytes: tensors larger than this are cut into items of at most this size.
        chunk_bytes: host compares split an item into ranges of whole multiples of this.
        threads: worker threads for comparing and coding.
        compress: allow zstd level 1 on buffers (kept only where it pays).
        baseline_dir: None keeps the host baseline in memory; else in an mmap'd file there.
        compare_on: where an item's bits are compared with its baseline. ``"auto"``: CPU
            tensors on the host (the compiled kernel), tensors on any other device on that
            device (torch ops; only changed indices and values reach the host). ``"host"``:
            every tensor on the host (a GPU tensor's owned spans are copied over first).
            ``"device"``: every tensor with torch ops on its own device, CPU tensors too.
        device_baseline: where items compared on a device keep their baseline:
            ``"device"`` (on that device: the owned bytes of device memory) or ``"pinned"``
            (page-locked host memory; each compare first copies the item's baseline to the
            device).
    """

    shard_rank: int = 0
    shard_count: int = 1
    bucket_size_bytes: int = 256 * _MiB
    max_item_bytes: int = 64 * _MiB
    chunk_bytes: int = 512 * 1024
    threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    compress: bool = True
    baseline_dir: str | os.PathLike[str] | None = None
    compare_on: Literal["auto", "host", "device"] = "auto"
    device_baseline: Literal["device", "pinned"] = "device"

    def __post_init__(self) -> None:
        if self.max_item_bytes > self.bucket_size_bytes:
            raise ValueError("max_item_bytes must not exceed bucket_size_bytes")
        if min(self.bucket_size_bytes, self.max_item_bytes, self.chunk_bytes, self.threads) < 1:
            raise ValueError(f"sizes and threads must be positive: {self}")
        if self.compare_on not in ("auto", "host", "device"):
            raise ValueError(f"compare_on must be auto, host or device, got {self.compare_on!r}")
        if self.device_baseline not in ("device", "pinned"):
            raise ValueError(
                f"device_baseline must be device or pinned, got {self.device_baseline!r}"
            )


@dataclass(frozen=True)
class TrackerTraffic:
    """What the last ``encode`` (or ``load_baseline``) read and moved.

    Attributes:
        read_bytes: bytes of the given tensors read: exactly the bytes of the items this
            producer owns (never a whole tensor it only owns part of).
        to_host_bytes: bytes copied from a device to the host: for items compared on a
            device, the changed indices and values (and RANGE or dense spans); for device
            tensors compared on the host, their owned spans.
    """

    read_bytes: int = 0
    to_host_bytes: int = 0


@dataclass
class _Pending:
    """A refit encoded (or being encoded) but not yet committed."""

    target: WeightVersion
    writes: list[PendingWrite] = field(default_factory=list)
    complete: bool = False


def _named(
    tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        yield from tensors.items()
    else:
        for named in tensors:
            yield named.name, named.tensor


class DeltaCompressionTracker:
    """Holds the last committed bits of the tensors this producer owns and encodes refits.

    A refit is ``encode`` (iterate every payload and send it), then ``commit()`` once every
    receiver confirmed, or ``abort()`` if anything failed: the baseline then still holds the
    committed bits and the next ``encode`` re-sends whatever differs from them. Without a
    committed baseline (the first refit, or after a failed first refit) and with
    ``resync=True`` every item is sent DENSE with no base, which any receiver accepts.

    Encoding only reads the baseline; the tracker keeps what each payload carried (the raw
    location and value arrays, the payload's size before compression; a full copy for a
    resync) and ``commit()`` writes it into the baseline, so ``abort()`` just drops it. A first
    refit copies the new bits straight into the (empty) baseline, and its payload buffers
    share that memory: they stay valid until the next ``commit()``.

    Only the bytes of owned items are read (:attr:`traffic` counts them): a tensor this
    producer owns part of is never copied whole. Tensors on a GPU are compared there (see
    ``TrackerConfig.compare_on``) against a baseline on the GPU or in pinned host memory, and
    only changed indices and values cross to the host.

    Args:
        spec: every tensor of the state dict (the same on every producer).
        config: sharding, bucketing, storage and coding settings.
    """

    def __init__(self, spec: StateDictInfo, config: TrackerConfig | None = None) -> None:
        self.config = config or TrackerConfig()
        self._spec: dict[str, TensorSpec] = dict(spec)
        self.items: tuple[ItemSpan, ...] = tuple(
            shard_items(
                spec,
                shard_rank=self.config.shard_rank,
                shard_count=self.config.shard_count,
                max_item_bytes=self.config.max_item_bytes,
            )
        )
        self._by_name: dict[str, list[ItemSpan]] = {}
        for item in self.items:
            self._by_name.setdefault(item.name, []).append(item)
        self._store = BaselineStore(self.items, self.config.baseline_dir)
        self._device_store = DeviceBaselines(pinned=self.config.device_baseline == "pinned")
        self._traffic = {"read_bytes": 0, "to_host_bytes": 0}
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="refit-delta")
        self._version: WeightVersion | None = None
        self._pending: _Pending | None = None
        if self.config.compare_on != "device":
            prepare_kernel(getattr(torch, self._spec[i.name].dtype).itemsize for i in self.items)

    @property
    def version(self) -> WeightVersion | None:
        """The committed baseline's version; None before the first commit."""
        return self._version

    @property
    def pending(self) -> WeightVersion | None:
        """The target of the refit encoded but not yet committed or aborted."""
        return None if self._pending is None else self._pending.target

    @property
    def baseline_bytes(self) -> int:
        """Bytes of baseline this producer holds (host slots are reserved for every owned
        item; device slots are counted once made)."""
        return self._store.nbytes + self._device_store.nbytes

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._spec.get(name)
        if spec is None:
            raise GeometryMismatchError(f"tensor {name!r} is not in the tracker's state dict")
        if TensorSpec.of(tensor) != spec:
            raise GeometryMismatchError(
                f"tensor {name!r} is {TensorSpec.of(tensor)}, expected {spec}"
            )

    def _on_device(self, tensor: torch.Tensor) -> bool:
        mode = self.config.compare_on
        return mode == "device" or (mode == "auto" and tensor.device.type != "cpu")

    def _read(self, item: ItemSpan, bits: torch.Tensor) -> HostBits | DeviceBits:
        """Exactly the item's bytes of ``bits`` (the tensor's integer view), where they belong."""
        if self._on_device(bits):
            return DeviceBits(read_span(bits, item.start, item.stop))
        if bits.device.type == "cpu":
            span = read_span(bits, item.start, item.stop)
            return HostBits(span.numpy().view(np.uint8))
        host = torch.empty(item.numel, dtype=bits.dtype, pin_memory=bits.device.type == "cuda")
        read_span(bits, item.start, item.stop, out=host)
        self._traffic["to_host_bytes"] += item.nbytes
        return HostBits(host.numpy().view(np.uint8))

    def _slot(self, item: ItemSpan, new: HostBits | DeviceBits) -> np.ndarray | torch.Tensor:
        if isinstance(new, DeviceBits):
            return self._device_store.slot(item, new.data)
        return self._store.slot(item)

    def _owned(
        self, tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[ItemSpan, np.ndarray | torch.Tensor, HostBits | DeviceBits]]:
        """(item, its baseline slot, its new bits) for every owned item, reading only owned
        bytes; checks names, specs and completeness."""
        seen: set[str] = set()
        self._traffic = {"read_bytes": 0, "to_host_bytes": 0}
        for name, tensor in _named(tensors):
            if name in seen:
                raise GeometryMismatchError(f"tensor {name!r} given twice")
            seen.add(name)
            self._check(name, tensor)
            bits = int_view(tensor.detach())
            for item in self._by_name.get(name, ()):
                new = self._read(item, bits)
                self._traffic["read_bytes"] += item.nbytes
                yield item, self._slot(item, new), new
        missing = self._by_name.keys() - seen
        if missing:
            raise GeometryMismatchError(f"tensors missing from the refit: {sorted(missing)}")

    @property
    def traffic(self) -> TrackerTraffic:
        """Bytes read from the tensors and moved to the host by the last encode or load."""
        return TrackerTraffic(**self._traffic)

    def _require_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                f"refit to version {self._pending.target.value} is pending; commit or abort it first"
            )

    def load_baseline(
        self, tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor], version: WeightVersion
    ) -> None:
        """Adopt ``tensors`` as the committed bits of ``version`` (receivers already hold them)."""
        self._require_idle()
        encoder = self._encoder(version, dense=True, has_baseline=False, code=False)
        self._version = None
        try:
            for item, slot, new in self._owned(tensors):
                encoder.add(item, slot, new)
        finally:
            encoder.settle()
            self._traffic["to_host_bytes"] += encoder.to_host_bytes
        self._version = version
        logger.info("baseline loaded at version %d (%d bytes)", version.value, self._store.nbytes)

    def _encoder(
        self, target: WeightVersion, *, dense: bool, has_baseline: bool, code: bool = True
    ) -> BucketEncoder:
        return BucketEncoder(
            self._pool,
            threads=self.config.threads,
            chunk_bytes=self.config.chunk_bytes,
            base=self._version,
            target=target,
            dense=dense,
            has_baseline=has_baseline,
            compress=self.config.compress,
            code=code,
        )

    def encode(
        self,
        tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
        target: WeightVersion,
        *,
        resync: bool = False,
    ) -> Generator[DeltaPayload, None, None]:
        """Payloads that bring receivers from the committed version to ``target``.

        Consume the iterator fully, then ``commit()`` or ``abort()``. An error while encoding
        (a missing or mismatched tensor) aborts the refit before it propagates.

        Args:
            tensors: the new weights: a ``WeightSource.iter_tensors()`` stream or a mapping.
            target: the new version; must follow the committed one.
            resync: send every owned item DENSE with no base (for receivers that lost track).
        """
        self._require_idle()
        if self._version is not None:
            self._version.require_advance_to(target)
        self._pending = _Pending(target)
        return self._encode(tensors, self._pending, resync or self._version is None)

    def _encode(
        self,
        tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
        pending: _Pending,
        dense: bool,
    ) -> Generator[DeltaPayload, None, None]:
        has_baseline = self._version is not None
        limit = self.config.bucket_size_bytes
        encoder: BucketEncoder | None = None
        try:
            for item, slot, new in self._owned(tensors):
                if encoder is not None and encoder.nbytes + item.nbytes > limit:
                    done, encoder = encoder, None
                    yield self._finish(done, pending)
                if encoder is None:
                    encoder = self._encoder(pending.target, dense=dense, has_baseline=has_baseline)
                encoder.add(item, slot, new)
            if encoder is not None:
                done, encoder = encoder, None
                yield self._finish(done, pending)
        except BaseException:
            if encoder is not None:
                encoder.settle()
            self.abort()
            raise
        pending.complete = True

    def _finish(self, encoder: BucketEncoder, pending: _Pending) -> DeltaPayload:
        try:
            bucket = encoder.finish()
        finally:
            encoder.settle()
            self._traffic["to_host_bytes"] += encoder.to_host_bytes
        pending.writes.extend(bucket.writes)
        payload = bucket.payload
        logger.debug(
            "payload for version %d: %d items, %d dense bytes, %d changed, %d wire bytes",
            pending.target.value,
            len(payload.items),
            payload.dense_bytes,
            payload.changed_elements,
            payload.nbytes,
        )
        return payload

    def commit(self) -> WeightVersion:
        """Every receiver holds the pending version: make it the baseline; return it."""
        if self._pending is None or not self._pending.complete:
            raise RuntimeError("no fully encoded refit to commit")
        pending, self._pending = self._pending, None
        try:
            for _ in self._pool.map(PendingWrite.write, pending.writes):
                pass
        except BaseException:
            self._version = None
            logger.exception("commit failed half-way; the next refit will be a dense resync")
            raise
        self._version = pending.target
        logger.info("baseline committed at version %d", self._version.value)
        return self._version

    def abort(self) -> None:
        """Forget the pending refit: the baseline goes back to the committed bits."""
        if self._pending is None:
            return
        target = self._pending.target
        self._pending = None
        logger.info(
            "refit to version %d aborted; baseline stays at %s", target.value, self._version
        )

    def close(self) -> None:
        """Abort any pending refit and release threads and baseline storage."""
        self.abort()
        self._pool.shutdown(wait=True)
        self._store.close()
        self._device_store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
