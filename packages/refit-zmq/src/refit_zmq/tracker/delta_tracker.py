"""The producer side of sparse refits: the last committed bits, and payloads against them."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Self

import numpy as np
import torch

from refit_core import GeometryMismatchError, NamedTensor, StateDictInfo, TensorSpec, WeightVersion
from refit_zmq.codec.dtypes import flat_bits
from refit_zmq.codec.format import DeltaPayload
from refit_zmq.tracker.encoder import BucketEncoder, PendingWrite
from refit_zmq.tracker.plan import ItemSpan, shard_items
from refit_zmq.tracker.store import BaselineStore

__all__ = ["DeltaCompressionTracker", "TrackerConfig"]

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
        chunk_bytes: bytes of baseline (and of new bits) compared per task; cache-sized.
        threads: worker threads for comparing and coding.
        compress: allow zstd level 1 on buffers (kept only where it pays).
        baseline_dir: None keeps the baseline in memory; else in an mmap'd file there.
    """

    shard_rank: int = 0
    shard_count: int = 1
    bucket_size_bytes: int = 256 * _MiB
    max_item_bytes: int = 64 * _MiB
    chunk_bytes: int = 512 * 1024
    threads: int = field(default_factory=lambda: min(4, os.cpu_count() or 1))
    compress: bool = True
    baseline_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.max_item_bytes > self.bucket_size_bytes:
            raise ValueError("max_item_bytes must not exceed bucket_size_bytes")
        if min(self.bucket_size_bytes, self.max_item_bytes, self.chunk_bytes, self.threads) < 1:
            raise ValueError(f"sizes and threads must be positive: {self}")


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
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="refit-delta")
        self._version: WeightVersion | None = None
        self._pending: _Pending | None = None

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
        """Bytes of baseline this producer holds."""
        return self._store.nbytes

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._spec.get(name)
        if spec is None:
            raise GeometryMismatchError(f"tensor {name!r} is not in the tracker's state dict")
        if TensorSpec.of(tensor) != spec:
            raise GeometryMismatchError(
                f"tensor {name!r} is {TensorSpec.of(tensor)}, expected {spec}"
            )

    def _owned(
        self, tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[ItemSpan, np.ndarray]]:
        """(item, its new bytes) for every owned item; checks names, specs and completeness."""
        seen: set[str] = set()
        for name, tensor in _named(tensors):
            if name in seen:
                raise GeometryMismatchError(f"tensor {name!r} given twice")
            seen.add(name)
            self._check(name, tensor)
            owned = self._by_name.get(name, ())
            if not owned:
                continue
            bits = flat_bits(tensor.detach().cpu().contiguous()).view(np.uint8)
            for item in owned:
                size = item.dtype.itemsize
                yield item, bits[item.start * size : item.stop * size]
        missing = self._by_name.keys() - seen
        if missing:
            raise GeometryMismatchError(f"tensors missing from the refit: {sorted(missing)}")

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
            for item, new in self._owned(tensors):
                encoder.add(item, self._store.slot(item), new)
        finally:
            encoder.settle()
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
            for item, new in self._owned(tensors):
                if encoder is not None and encoder.nbytes + item.nbytes > limit:
                    done, encoder = encoder, None
                    yield self._finish(done, pending)
                if encoder is None:
                    encoder = self._encoder(pending.target, dense=dense, has_baseline=has_baseline)
                encoder.add(item, self._store.slot(item), new)
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
