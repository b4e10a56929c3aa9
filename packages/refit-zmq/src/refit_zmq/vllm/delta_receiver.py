"""The relay receiver of a vLLM worker: stages each transfer's deltas, transactionally.

A relay applies payloads to its receiver while a transfer runs; here nothing is written then.
Each verified payload is decoded into the writes this worker's part of it needs
(:meth:`~refit_zmq.vllm.targets.CheckpointTargets.stage`) and kept with its transfer; a
rollback drops them, a commit queues them for the worker's next update session
(:meth:`StagedDeltas.take_committed`), which applies them to the model while the engine is
closed. So a failed transfer never touches the model and costs nothing to undo, and the
staged writes of a 1 % delta hold about the changed bytes plus their positions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import ProtocolError, WeightVersion
from refit_zmq.codec import DecodedItem, check_item, decode_locations, decode_payload, unpack_buffer
from refit_zmq.codec.dtypes import unsigned_numpy_dtype
from refit_zmq.relay import (
    AbortReply,
    ApplyResult,
    CommitReply,
    ReceiverOpen,
    ReceiverStatus,
    StaleTransferError,
    admit_target,
)
from refit_zmq.relay.apply.receiver import check_declared
from refit_zmq.vllm.targets import CheckpointTargets, StagedWrite

__all__ = ["StagedDeltas"]

logger = logging.getLogger(__name__)


@dataclass
class _Open:
    transfer_id: str
    target: WeightVersion
    writes: list[StagedWrite] = field(default_factory=list)
    payloads: int = 0

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.writes)


class StagedDeltas:
    """A relay :class:`~refit_zmq.relay.Receiver` that stages deltas for one worker.

    Relay calls come from the relay's receiver thread, :meth:`take_committed` and
    :meth:`restore_version` from the worker's thread; a lock orders them.

    Args:
        targets: where the worker's checkpoint tensors live.
        specs: checkpoint name -> shape and dtype the payloads must match.
        version: the version the model holds.
        max_staged_bytes: refuse a transfer whose staged writes would pass this (default:
            four times the checkpoint's bytes).
    """

    def __init__(
        self,
        targets: CheckpointTargets,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        version: int,
        max_staged_bytes: int | None = None,
    ) -> None:
        self._targets = targets
        self._specs = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in specs.items()}
        total = sum(t.numel() * t.element_size() for t in self._specs.values())
        self._max_staged_bytes = 4 * total if max_staged_bytes is None else max_staged_bytes
        self._version = WeightVersion(version)
        self._began = self._version
        self._open: _Open | None = None
        self._committed_id: str | None = None
        self._pending: list[StagedWrite] = []
        self._lock = threading.Lock()

    def apply(self, body: memoryview, metadata: Mapping[str, Any]) -> ApplyResult:
        """Verify one payload and stage this worker's writes of it.

        Raises:
            ChecksumMismatchError, ProtocolError, StaleBaseError, GeometryMismatchError,
            StaleTransferError, TransferConflictError: the payload is refused (nothing of it is
                kept).
        """
        decoded = decode_payload(body)
        transfer_id = str(metadata["transfer_id"])
        check_declared(metadata, (i.header for i in decoded.items), transfer_id)
        with self._lock:
            for item in decoded.items:
                check_item(item.header, self._specs, self._version)
            opened = None if self._open is None else (self._open.transfer_id, self._open.target)
            target = admit_target(
                (i.header.target for i in decoded.items),
                transfer_id,
                held=self._version,
                opened=opened,
            )
            writes = [w for item in decoded.items for w in self._stage(item)]
            held = sum(w.nbytes for w in writes) + (0 if self._open is None else self._open.nbytes)
            if held > self._max_staged_bytes:
                raise ProtocolError(
                    f"staged writes would reach {held} bytes (limit {self._max_staged_bytes})"
                )
            if self._open is None:
                self._open = _Open(transfer_id, target)
                self._began = max(self._began, target)
            self._open.writes.extend(writes)
            self._open.payloads += 1
        return ApplyResult(len(decoded.items), decoded.nbytes, 0)

    def _stage(self, item: DecodedItem) -> list[StagedWrite]:
        header = item.header
        if item.values is None:
            return []
        raw = None if item.locations is None else unpack_buffer(item.locations)
        indices = decode_locations(header, raw)
        if indices is not None:
            indices += header.span_start
        values = unpack_buffer(item.values).view(unsigned_numpy_dtype(header.itemsize))
        return self._targets.stage(header, indices, values)

    def commit(self, transfer_id: str) -> CommitReply:
        """Queue the open transfer's writes for the worker (again: a no-op answer)."""
        with self._lock:
            opened = self._open
            if opened is None or opened.transfer_id != transfer_id:
                if transfer_id == self._committed_id:
                    return CommitReply(transfer_id, self._version.value, committed=False)
                raise StaleTransferError(f"transfer {transfer_id} is not open here; cannot commit")
            self._open = None
            self._pending.extend(opened.writes)
            self._version = opened.target
            self._committed_id = transfer_id
        logger.info("transfer %s committed: version %d staged", transfer_id, opened.target.value)
        return CommitReply(transfer_id, opened.target.value, committed=True)

    def rollback(self, transfer_id: str) -> AbortReply:
        """Drop the open transfer (nothing held: a no-op answer)."""
        with self._lock:
            if transfer_id == self._committed_id:
                raise StaleTransferError(
                    f"transfer {transfer_id} is committed; it cannot roll back"
                )
            opened = self._open
            if opened is None or opened.transfer_id != transfer_id:
                return AbortReply(transfer_id, self._version.value, aborted=False, restored=False)
            self._open = None
        logger.info("transfer %s rolled back (%d payloads)", transfer_id, opened.payloads)
        # Staged writes never reached the model: nothing to restore there.
        return AbortReply(transfer_id, self._version.value, aborted=True, restored=False)

    def status(self, *, digests: bool = False) -> ReceiverStatus:
        """The committed version and the open transfer.

        Raises:
            ProtocolError: ``digests`` asked: staged deltas reach the model only after the
                commit, so there is nothing to compare before it.
        """
        if digests:
            raise ProtocolError(
                "a vLLM worker applies deltas after the commit: digests before it would show "
                "the previous version (verify the served weights after the refit instead)"
            )
        with self._lock:
            opened = self._open
            return ReceiverStatus(
                self._version.value,
                None
                if opened is None
                else ReceiverOpen(
                    opened.transfer_id, opened.target.value, opened.payloads, opened.nbytes
                ),
                began=self._began.value,
            )

    def take_committed(self) -> tuple[int, list[StagedWrite]]:
        """The committed version and the writes that bring the model to it (handed over
        once)."""
        with self._lock:
            writes, self._pending = self._pending, []
            return self._version.value, writes

    def restore_version(self, version: int) -> None:
        """The model stayed on ``version`` (its writes were undone): the next transfer must
        start from there (a dense resync)."""
        with self._lock:
            self._version = WeightVersion(version)
            self._pending = []
        logger.warning("the model stays on version %d; the next refit resyncs it", version)
