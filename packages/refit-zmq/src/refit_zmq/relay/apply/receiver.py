"""What a relay applies payloads to: apply, then commit or roll back one transfer at a time.

:class:`TensorReceiver` applies delta payloads in place to a receiver's tensors as their bytes
arrive (:class:`~refit_zmq.relay.apply.payload_stream.PayloadStream`), with the codec's undo log kept
per transfer, so a transfer that fails anywhere in the tree is rolled back bit for bit, and
only a committed transfer moves the receiver's version.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from refit_core import ProtocolError, WeightVersion
from refit_zmq.codec import ItemHeader, PayloadLayout, UndoLog, tensor_digest
from refit_zmq.codec.undo_arena import UndoArena
from refit_zmq.relay.apply.payload_stream import ByteViews, PayloadStream, StreamResult
from refit_zmq.relay.wire.errors import StaleTransferError, TransferConflictError
from refit_zmq.relay.wire.reports import (
    AbortReply,
    ApplyResult,
    CommitReply,
    ReceiverOpen,
    ReceiverStatus,
)

__all__ = [
    "PayloadSink",
    "Receiver",
    "StreamingReceiver",
    "TensorReceiver",
    "admit_target",
    "as_receiver",
    "check_declared",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class Receiver(Protocol):
    """The local side of a relay. Calls come from one thread, one at a time.

    ``apply`` raises a refit error to refuse a payload (nothing of it may stay applied);
    ``commit`` and ``rollback`` end the open transfer and are idempotent per transfer id.
    ``metadata`` holds the BEGIN's fields (``transfer_id``, ``producer_id``, ``payload_id``,
    ``checksum``, ``base``, ``target``, ``verification_candidates``); a receiver refuses a
    payload whose items name another base or target than its BEGIN.
    """

    def apply(self, body: memoryview, metadata: Mapping[str, Any]) -> ApplyResult:
        """Apply one payload of ``metadata["transfer_id"]``, keeping what undoes it."""
        ...

    def commit(self, transfer_id: str) -> CommitReply:
        """Make the transfer's target the current version and forget its undo data
        (``committed`` False when it was committed before)."""
        ...

    def rollback(self, transfer_id: str) -> AbortReply:
        """Restore the bits from before the transfer's first payload (``restored`` False when
        nothing of it is held; ``aborted`` says the same from the receiver's side)."""
        ...

    def status(self, *, digests: bool = False) -> ReceiverStatus:
        """The version held, the open transfer, and with ``digests`` every tensor's digest."""
        ...


class PayloadSink(Protocol):
    """One payload handed to a receiver while it arrives: its bytes in order, then the end."""

    def feed(self, chunk: memoryview) -> None:
        """Take the payload's next bytes; never raises (a failure surfaces in ``finish``)."""
        ...

    def finish(self) -> ApplyResult:
        """Verify and keep the payload: ``apply``'s result and errors; after an error nothing
        of the payload stays applied."""
        ...

    def abandon(self) -> None:
        """Undo whatever the payload wrote; it will not be finished."""
        ...


@runtime_checkable
class StreamingReceiver(Receiver, Protocol):
    """A receiver that applies payloads as they arrive (the relay then never stages a payload
    whole for it)."""

    def open_payload(self, metadata: Mapping[str, Any]) -> PayloadSink:
        """A sink for one payload (``apply``'s metadata); must not raise."""
        ...


def as_receiver(apply_payload: Receiver | Callable[..., Any]) -> Receiver:
    """A receiver object, or the receiver whose bound ``apply`` was given.

    Raises:
        TypeError: a bare callable, which cannot commit or roll back a transfer.
    """
    if isinstance(apply_payload, Receiver):
        return apply_payload
    owner = getattr(apply_payload, "__self__", None)
    if isinstance(owner, Receiver):
        return owner
    raise TypeError(
        "the relay needs a receiver with apply, commit, rollback and status (or its bound "
        "apply); a bare apply function cannot roll a failed transfer back"
    )


@dataclass
class _Open:
    """The transfer the receiver holds open: from the moment its first payload was admitted
    (the engine told ``on_begin``) until its commit or rollback (the engine told that)."""

    transfer_id: str
    target: WeightVersion
    undo: UndoLog = field(default_factory=UndoLog)
    payloads: int = 0


_ENDED_KEPT = 1024
"""Ended (committed or rolled back) transfer ids a receiver remembers, to refuse late work."""


class TensorReceiver:
    """Applies delta payloads to named tensors in place, transactionally.

    Args:
        tensors: name -> tensor the payloads write (views into an engine's parameters work).
        version: the version the tensors hold (None: unknown, so only a resync applies).
        on_begin: called with a transfer's target version before its first payload writes a
            byte (an engine stops generating there). Every transfer begun ends in exactly one
            ``on_commit`` or ``on_rollback``, whatever became of its payloads.
        on_commit: called with the new version after a commit (set the engine's version,
            reset its prefix cache).
        on_rollback: called with the target version after a rollback restored the old bits
            (also when none of the transfer's payloads stayed applied).
        max_undo_bytes: refuse a payload whose undo data would pass this (default: four
            times the tensors' bytes, enough for any legitimate transfer).
        undo_pool_bytes: host memory kept from one transfer's undo copies for the next
            (default: the host tensors' bytes, what a dense resync needs; 0: none). Fresh
            memory costs page faults on first touch, more than the copy itself.
        seed: seed of the sampled read-back.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        version: int | None,
        on_begin: Callable[[int], None] | None = None,
        on_commit: Callable[[int], None] | None = None,
        on_rollback: Callable[[int], None] | None = None,
        max_undo_bytes: int | None = None,
        undo_pool_bytes: int | None = None,
        seed: int = 0,
    ) -> None:
        self._tensors = dict(tensors)
        self._version = None if version is None else WeightVersion(version)
        self._on_begin = on_begin
        self._on_commit = on_commit
        self._on_rollback = on_rollback
        self._began = self._version
        self._ended: deque[str] = deque(maxlen=_ENDED_KEPT)
        state_bytes = _nbytes(self._tensors.values())
        self._max_undo_bytes = 4 * state_bytes if max_undo_bytes is None else max_undo_bytes
        self._rng = np.random.default_rng(seed)
        host_bytes = _nbytes(t for t in self._tensors.values() if t.device.type == "cpu")
        self._arena = UndoArena(
            max_pooled_bytes=host_bytes if undo_pool_bytes is None else undo_pool_bytes
        )
        self._open_sinks = 0
        self._views = ByteViews(self._tensors)
        self._open: _Open | None = None
        self._committed: str | None = None

    @property
    def version(self) -> int | None:
        """The committed version."""
        return None if self._version is None else self._version.value

    @property
    def began_version(self) -> int | None:
        """The highest version a transfer ever began here (committed or not)."""
        return None if self._began is None else self._began.value

    def apply(self, body: memoryview, metadata: Mapping[str, Any]) -> ApplyResult:
        """Verify and apply one payload whole (see :class:`Receiver` and :meth:`open_payload`)."""
        sink = self._open_payload(metadata, chunked=False)
        sink.feed(body)
        return sink.finish()

    def open_payload(self, metadata: Mapping[str, Any]) -> PayloadSink:
        """A sink that applies one payload as its bytes arrive.

        Its ``finish`` raises ChecksumMismatchError (the bytes are not what
        ``metadata["checksum"]`` names), StaleBaseError (a delta against another version),
        StaleTransferError (the target does not follow the committed version),
        TransferConflictError (another transfer is open, or another target),
        VerificationError (the read-back found other bits than the payload carries), or
        ProtocolError and GeometryMismatchError (malformed, items that name another base or
        target than the BEGIN, a chunk holding bytes of two frames, or not for these
        tensors); the payload's writes are undone first.
        """
        return self._open_payload(metadata, chunked=True)

    def _open_payload(self, metadata: Mapping[str, Any], *, chunked: bool) -> PayloadSink:
        transfer_id = str(metadata["transfer_id"])
        declared = _Declared.of(metadata)

        def admit(layout: PayloadLayout) -> None:
            items = [item for item, _ in layout.items]
            declared.check(items, transfer_id)
            target = self._target(_targets(items), transfer_id)
            if transfer_id in self._ended:
                raise StaleTransferError(f"transfer {transfer_id} has ended here")
            if self._open is None:
                self._open = _Open(transfer_id, target)
                self._began = target if self._began is None else max(self._began, target)
                if self._on_begin is not None:
                    self._on_begin(target.value)

        stream = PayloadStream(
            self._tensors,
            self._version,
            admit=admit,
            candidates=int(metadata.get("verification_candidates", 0)),
            rng=self._rng,
            views=self._views,
            undo_memory=self._arena.take,
            chunked=chunked,
        )
        self._open_sinks += 1
        return _IncomingPayload(
            stream,
            lambda kept: self._sink_closed(transfer_id, kept),
            str(metadata["checksum"]),
            lambda result: self._keep(result, stream.undo, transfer_id),
        )

    def _sink_closed(self, transfer_id: str, kept: bool) -> None:
        """A payload of ``transfer_id`` was kept, or refused or abandoned (and undone). A
        transfer that keeps nothing ends at once: its engine is told (``on_rollback``) and
        later payloads of it are refused (it aborts everywhere anyway)."""
        self._open_sinks -= 1
        opened = self._open
        if kept or opened is None or opened.transfer_id != transfer_id or opened.payloads:
            return
        self._open = None
        self._ended.append(transfer_id)
        self._recycle_undo()
        logger.info("transfer %s ended here: its only payload so far was refused", transfer_id)
        if self._on_rollback is not None:
            self._on_rollback(opened.target.value)

    def _recycle_undo(self) -> None:
        """The transfer ended: its undo memory serves the next one (unless a payload of
        another is still streaming into the arena)."""
        if self._open_sinks == 0:
            self._arena.recycle()

    def _keep(self, result: StreamResult, undo: UndoLog, transfer_id: str) -> ApplyResult:
        """Adopt a finished payload's undo data into the open transfer."""
        target = self._target(_targets(result.items), transfer_id)
        held = undo.nbytes + (0 if self._open is None else self._open.undo.nbytes)
        if held > self._max_undo_bytes:
            raise ProtocolError(
                f"undo data would reach {held} bytes (limit {self._max_undo_bytes})"
            )
        opened = self._open
        if opened is None or opened.transfer_id != transfer_id or opened.target != target:
            raise StaleTransferError(f"transfer {transfer_id} ended while a payload streamed")
        opened.undo.extend(undo)
        opened.payloads += 1
        return ApplyResult(len(result.items), result.nbytes, result.verified)

    def _target(self, targets: frozenset[WeightVersion], transfer_id: str) -> WeightVersion:
        """The one target of a payload, if this receiver may apply it in ``transfer_id``."""
        opened = None if self._open is None else (self._open.transfer_id, self._open.target)
        return admit_target(targets, transfer_id, held=self._version, opened=opened)

    def commit(self, transfer_id: str) -> CommitReply:
        """Commit the open transfer (again: a no-op answer)."""
        if self._open is None or self._open.transfer_id != transfer_id:
            if transfer_id == self._committed:
                return CommitReply(transfer_id, self.version, committed=False)
            raise StaleTransferError(f"transfer {transfer_id} is not open here; cannot commit")
        opened, self._open = self._open, None
        opened.undo.discard()
        self._recycle_undo()
        self._version = opened.target
        self._committed = transfer_id
        self._ended.append(transfer_id)
        logger.info("transfer %s committed: version %d", transfer_id, opened.target.value)
        if self._on_commit is not None:
            self._on_commit(opened.target.value)
        return CommitReply(transfer_id, self.version, committed=True)

    def rollback(self, transfer_id: str) -> AbortReply:
        """Roll the open transfer back (nothing held: a no-op answer)."""
        if transfer_id == self._committed:
            raise StaleTransferError(f"transfer {transfer_id} is committed; it cannot roll back")
        if self._open is None or self._open.transfer_id != transfer_id:
            if transfer_id not in self._ended:
                self._ended.append(transfer_id)  # a late payload of it must not begin it
            return AbortReply(transfer_id, self.version, aborted=False, restored=False)
        opened, self._open = self._open, None
        self._ended.append(transfer_id)
        opened.undo.restore()
        self._recycle_undo()
        logger.info(
            "transfer %s rolled back (%d payloads); version stays %s",
            transfer_id,
            opened.payloads,
            self.version,
        )
        if self._on_rollback is not None:
            self._on_rollback(opened.target.value)
        return AbortReply(transfer_id, self.version, aborted=True, restored=opened.payloads > 0)

    def status(self, *, digests: bool = False) -> ReceiverStatus:
        """The version, the open transfer, and optionally every tensor's digest."""
        opened = self._open
        return ReceiverStatus(
            self.version,
            None
            if opened is None
            else ReceiverOpen(
                opened.transfer_id, opened.target.value, opened.payloads, opened.undo.nbytes
            ),
            {name: tensor_digest(t) for name, t in self._tensors.items()} if digests else None,
            self.began_version,
        )


@dataclass(frozen=True)
class _Declared:
    """The base and target a payload's BEGIN declared (None: not declared, a receiver called
    directly), which every item of the payload must name."""

    base: int | None
    target: int | None
    declared: bool

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> _Declared:
        declared = "target" in metadata
        base, target = metadata.get("base"), metadata.get("target")
        return cls(
            None if base is None else int(base), None if target is None else int(target), declared
        )

    def check(self, items: Iterable[ItemHeader], transfer_id: str) -> None:
        """Raise ``ProtocolError`` for an item whose base or target differs from the BEGIN's."""
        if not self.declared:
            return
        for item in items:
            base = None if item.base is None else item.base.value
            if (base, item.target.value) != (self.base, self.target):
                raise ProtocolError(
                    f"payload of transfer {transfer_id}: item {item.name!r} goes from "
                    f"{base} to {item.target.value}, its BEGIN from {self.base} to {self.target}"
                )


def check_declared(
    metadata: Mapping[str, Any], items: Iterable[ItemHeader], transfer_id: str
) -> None:
    """Refuse (``ProtocolError``) a payload item whose base or target differs from what the
    payload's BEGIN declared in ``metadata`` (nothing declared: a receiver called directly)."""
    _Declared.of(metadata).check(items, transfer_id)


def admit_target(
    targets: Iterable[WeightVersion],
    transfer_id: str,
    *,
    held: WeightVersion | None,
    opened: tuple[str, WeightVersion] | None,
) -> WeightVersion:
    """The one target version a payload of ``transfer_id`` names, if a receiver holding
    ``held`` (None: unknown) with ``opened`` (transfer id and target) open may take it.

    Raises:
        TransferConflictError: another transfer is open, or this one names another target.
        ProtocolError: the payload names more or less than one target.
        StaleTransferError: the target does not follow the held version.
    """
    if opened is not None and opened[0] != transfer_id:
        raise TransferConflictError(f"transfer {opened[0]} is open; {transfer_id} must wait")
    distinct = set(targets)
    if len(distinct) != 1:
        raise ProtocolError(f"payload names {len(distinct)} target versions")
    (target,) = distinct
    if held is not None and target <= held:
        raise StaleTransferError(
            f"transfer {transfer_id} targets version {target.value}, receiver holds {held.value}"
        )
    if opened is not None and opened[1] != target:
        raise TransferConflictError(
            f"transfer {transfer_id} targets {target.value} and {opened[1].value}"
        )
    return target


def _targets(items: Iterable[ItemHeader]) -> frozenset[WeightVersion]:
    return frozenset(item.target for item in items)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _IncomingPayload:
    """A :class:`TensorReceiver`'s sink: the stream, then ``keep`` once it verified."""

    def __init__(
        self,
        stream: PayloadStream,
        closed: Callable[[bool], None],
        checksum: str,
        keep: Callable[[StreamResult], ApplyResult],
    ) -> None:
        self._stream = stream
        self._closed = closed
        self._checksum = checksum
        self._keep = keep

    def feed(self, chunk: memoryview) -> None:
        self._stream.feed(chunk)

    def finish(self) -> ApplyResult:
        kept = False
        try:
            result = self._stream.finish(self._checksum)
            try:
                applied = self._keep(result)
            except BaseException:
                self._stream.undo.restore()
                raise
            kept = True
            return applied
        finally:
            self._closed(kept)

    def abandon(self) -> None:
        if not self._stream.finished:
            self._stream.abandon()
            self._closed(False)
