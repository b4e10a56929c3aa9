"""The colocated IPC synchronizer: tensor handles over ZMQ control sockets, ping-pong buffers.

Each refit: ``begin`` (the buffers' handles and the manifest) to every worker, then buckets
(the trainer fills one buffer while the workers load the other, and refills a buffer only
after every worker acknowledged it), then the completion sentinel ``commit``, on which each
worker checks its manifest and commits the version. Any failure sends ``abort`` to every
worker; workers that loaded part of the refit are named in ``wedged_workers``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from refit_core import (
    EngineReport,
    FleetStatus,
    RefitAbortedError,
    RefitError,
    RefitResult,
    RefitTimeoutError,
    TensorSpec,
    WeightSynchronizer,
    WorkerOutcome,
)
from refit_core.backend import Deadline, PolicyLike, check_field_types, with_engines
from refit_zmq.ipc.links import WorkerLinks
from refit_zmq.ipc.packing import Bucket, BufferPool, Packer
from refit_zmq.ipc.protocol import PROTOCOL, Op, manifest_to_json, slot_bytes
from refit_zmq.ipc.sizing import ALIGN_BYTES, default_buffer_bytes

__all__ = ["FleetReporter", "IpcOptions", "IpcWeightSynchronizer", "RefitSessions"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IpcOptions:
    """How the channel's buffers are laid out.

    Attributes:
        buffer_size_bytes: size of each of the two ping-pong buffers (rounded down to the slot
            alignment); None derives it from free memory (:mod:`refit_zmq.ipc.sizing`).
        device: where the buffers live (``"cpu"``: shared memory; ``"cuda[:i]"``: CUDA IPC);
            None picks the current CUDA device when there is one, else the CPU.
    """

    buffer_size_bytes: int | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)

    def resolve_device(self) -> torch.device:
        """The buffers' device, with a CUDA index."""
        if self.device is None:
            return (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device


@runtime_checkable
class RefitSessions(Protocol):
    """Workers that serve a refit only inside a session they run (vLLM's update session)."""

    def refit_started(self, version: int, timeout_s: float | None) -> None:
        """Open every worker's session; returns at once, the workers then serve the refit
        by its deadline (``timeout_s``: its wire form, ``Deadline.to_wire``)."""
        ...

    def refit_finished(self, version: int, committed: bool) -> None:
        """Close every session; after a commit the engines serve ``version``. After a failure
        it may raise a :class:`~refit_core.errors.RefitError` whose ``engines`` say what each
        engine serves now (added to the refit's own error)."""
        ...


@runtime_checkable
class FleetReporter(Protocol):
    """Workers whose controller-side object can say what each serves (vLLM's engines: their
    receivers' versions), so that a new synchronizer adopts them."""

    def fleet_status(self) -> FleetStatus:
        """Every worker, in the synchronizer's shard order."""
        ...


class IpcWeightSynchronizer(WeightSynchronizer):
    """Refits engine workers on this host through shared buffers (see the module docstring).

    Args:
        policy: the trainer (its ``weight_source()`` is read once per refit).
        workers: the workers' control addresses, in a stable order (index ``i`` is engine
            shard ``i`` for ``reconcile_communicator``); called again on every reconcile.
        refit_timeout_s: deadline of one refit (None disarms).
        options: buffer size and device.
        sessions: for workers that load a refit only inside a session of their own (vLLM's
            update session): opened before ``begin``, closed after the commit or abort.
    """

    def __init__(
        self,
        policy: PolicyLike,
        workers: Callable[[], Sequence[str]],
        *,
        refit_timeout_s: float | None = None,
        options: IpcOptions | None = None,
        sessions: RefitSessions | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        self._policy = policy
        self._workers = workers
        self._sessions = sessions
        self._options = options or IpcOptions()
        self._pool: BufferPool | None = None
        self._links: WorkerLinks | None = None
        self._session = ""
        self._stale = False

    @property
    def options(self) -> IpcOptions:
        """The options this synchronizer runs with."""
        return self._options

    # -- hooks ---------------------------------------------------------------------------

    def _init_communicator(self, deadline: Deadline) -> None:
        self._connect(frozenset())

    def _connect(self, absent: frozenset[int]) -> None:
        if self._pool is None:
            device = self._options.resolve_device()
            size = self._options.buffer_size_bytes or default_buffer_bytes(device)
            self._pool = BufferPool(size - size % ALIGN_BYTES, device)
            self._session = uuid.uuid4().hex
            logger.info("ipc: two %d-byte buffers on %s", self._pool.nbytes, device)
        addresses = list(self._workers())
        if any(shard >= len(addresses) for shard in absent):
            raise ValueError(f"absent shards {sorted(absent)} of {len(addresses)} workers")
        if self._links is not None:
            self._links.close()
            self._links = None
        self._links = WorkerLinks([a for i, a in enumerate(addresses) if i not in absent])
        self._stale = False

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        sessions = self._sessions
        if sessions is None:
            return self._transfer(version, deadline)
        sessions.refit_started(version, deadline.to_wire())
        try:
            result = self._transfer(version, deadline)
        except BaseException as exc:
            reports = _close_sessions(sessions, version)
            if not reports or not isinstance(exc, Exception):
                raise
            if isinstance(exc, RefitError):
                with_engines(exc, reports)
                raise
            failed = RefitError(f"refit to version {version} failed: {type(exc).__name__}: {exc}")
            raise with_engines(failed, reports) from exc
        loading = time.monotonic()
        sessions.refit_finished(version, committed=True)  # the engines load the refit
        done = time.monotonic()
        return replace(
            result,
            timings_s={**result.timings_s, "load": done - loading},
            total_s=result.total_s + done - loading,
        )

    def _transfer(self, version: int, deadline: Deadline) -> RefitResult:
        links, pool = self._links, self._pool
        assert links is not None and pool is not None
        if links.broken:
            raise RefitAbortedError("a worker timed out earlier: call reconcile_communicator")
        source = self._policy.weight_source()
        manifest = dict(source.state_dict_info())
        started = time.monotonic()
        try:
            links.send(self._begin(version, manifest, pool), deadline)
            buckets = Packer(manifest, pool).buckets(source.iter_tensors())
            wire, began = self._stream(links, buckets, version, deadline)
            streamed = time.monotonic()
            links.request({"op": Op.COMMIT, "version": version, "count": len(manifest)}, deadline)
        except RefitTimeoutError:
            self._stale = True
            raise
        except Exception as exc:
            wedged = self._settle(links, version, deadline)
            logger.warning("ipc: refit to %d failed; partial loads on %s", version, wedged)
            if isinstance(exc, RefitError):
                exc.wedged_workers = tuple(wedged)
            raise
        finally:
            pool.release_all()
        done = time.monotonic()
        return RefitResult(
            version=version,
            timings_s={
                "begin": began - started,
                "stream": streamed - began,
                "commit": done - streamed,
            },
            total_s=done - started,
            wire_bytes=wire,
            dense_bytes=sum(slot_bytes(spec) for spec in manifest.values()),
            workers=tuple(WorkerOutcome(a, True, version) for a in links.addresses),
        )

    def _begin(
        self, version: int, manifest: Mapping[str, TensorSpec], pool: BufferPool
    ) -> dict[str, object]:
        return {
            "op": Op.BEGIN,
            "protocol": PROTOCOL,
            "version": version,
            "session": self._session,
            "buffers": [buffer.handle.to_json() for buffer in pool.buffers],
            "manifest": manifest_to_json(manifest),
        }

    def _stream(
        self, links: WorkerLinks, buckets: Iterator[Bucket], version: int, deadline: Deadline
    ) -> tuple[int, float]:
        """With ``begin`` sent, send each bucket as soon as it is filled, so that the workers
        find the next one queued when they finish loading one; before the next fill, wait
        for the oldest request (``begin``, then the bucket whose buffer it reuses). The bytes
        sent and when ``begin`` was answered."""
        pool = self._pool
        assert pool is not None
        sent = 0
        began: float | None = None
        outstanding: deque[Bucket | None] = deque([None])  # None: begin
        try:
            for bucket in buckets:
                if pool.device.type == "cuda":
                    torch.cuda.current_stream(pool.device).synchronize()
                links.send(bucket.message(version), deadline)
                outstanding.append(bucket)
                sent += bucket.nbytes
                while len(outstanding) > 1:  # both buffers in flight: free the older
                    self._answered(links, outstanding.popleft(), deadline)
                    began = time.monotonic() if began is None else began
            while outstanding:
                self._answered(links, outstanding.popleft(), deadline)
        finally:
            for left in outstanding:
                if left is not None:
                    self._release(left)
        return sent, time.monotonic() if began is None else began

    def _answered(self, links: WorkerLinks, bucket: Bucket | None, deadline: Deadline) -> None:
        """Wait for every worker's answer to the oldest request, then free its bucket."""
        try:
            links.gather(deadline)
        finally:
            if bucket is not None:
                self._release(bucket)

    def _release(self, bucket: Bucket) -> None:
        assert self._pool is not None
        if bucket.oneoff is not None:
            bucket.oneoff.close()
        elif bucket.buffer is not None:
            self._pool.release(bucket.buffer)

    def _settle(self, links: WorkerLinks, version: int, deadline: Deadline) -> list[str]:
        try:
            return links.settle({"op": Op.ABORT, "version": version}, deadline)
        except RefitTimeoutError:
            self._stale = True
            raise

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """What the workers serve, where their sessions object can say (``FleetReporter``)."""
        if not isinstance(self._sessions, FleetReporter):
            raise NotImplementedError(f"{type(self).__name__} cannot ask these workers")
        return self._sessions.fleet_status()

    def _is_stale(self) -> bool:
        return self._stale

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        self._connect(absent_shards)

    def _shutdown(self) -> None:
        if self._links is not None:
            self._links.close()
        if self._pool is not None:
            self._pool.close()


def _close_sessions(sessions: RefitSessions, version: int) -> tuple[EngineReport, ...]:
    """End the workers' sessions after a failed refit; what each engine serves now (as far
    as the sessions say)."""
    try:
        sessions.refit_finished(version, committed=False)
    except RefitError as closing:
        return closing.engines
    except Exception:
        logger.warning("ipc: closing the workers' sessions failed", exc_info=True)
    return ()
