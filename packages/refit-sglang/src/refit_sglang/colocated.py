"""The colocated SGLang synchronizer: flattened buckets handed over as tensor handles.

Each bucket is flattened into a buffer the engine can map (shared memory on CPU, CUDA IPC on
GPU) by a :class:`~refit_sglang.sources.BucketSource` (one in-process policy, or trainer ranks
gathering to the engine's first rank through Ray), passed to every engine's
``update_weights_from_tensor`` with ``load_format="flattened_bucket"`` (one serialization per
tensor-parallel rank: each is that rank's own reference), and released as soon as every engine has answered. The last bucket carries the weight version; the cache is
flushed before generation continues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass

from refit_core import (
    EngineReport,
    EngineState,
    RefitError,
    RefitResult,
    RefitTimeoutError,
    WeightSynchronizer,
    WorkerOutcome,
)
from refit_core.backend import Deadline, PolicyLike, check_field_types
from refit_sglang.client import SGLangClient
from refit_sglang.lifecycle import (
    LIFECYCLE_ROUTES,
    PauseMode,
    check_pause_mode,
    flush_caches,
    paused,
)
from refit_sglang.sources import BucketSource, LocalBuckets, Payload

__all__ = ["ColocatedOptions", "ColocatedSGLangSynchronizer", "require_bounded"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_SIZE_BYTES = 512 * 1024**2
ROUTES = (*LIFECYCLE_ROUTES, "update_weights_from_tensor")
"""Every route the colocated row calls."""


def require_bounded(clients: Sequence[SGLangClient]) -> None:
    """ValueError unless every client's calls can be bounded (a deadline needs that)."""
    unbounded = [c.label for c in clients if not c.bounded]
    if unbounded:
        raise ValueError(
            f"refit_timeout_s cannot be enforced on in-process engines {unbounded}: their "
            "calls cannot be interrupted; pass refit_timeout_s=None or use HTTP servers"
        )


@dataclass(frozen=True)
class ColocatedOptions:
    """Tuning of a :class:`ColocatedSGLangSynchronizer`.

    Attributes:
        bucket_size_bytes: most bytes per flattened bucket (``refit_buffer_size_gb``).
        pause_mode: how generation pauses around a refit (``abort`` or ``retract``).
        control_timeout_s: bound of every call when no deadline is armed.
        device: where an in-process policy's bucket buffers live (``cpu``: shared memory;
            ``cuda``: CUDA IPC).
    """

    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    pause_mode: PauseMode = "abort"
    control_timeout_s: float = 60.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_pause_mode(self.pause_mode)  # first: in_place has a reason of its own
        check_field_types(self)
        if self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes}")


class ColocatedSGLangSynchronizer(WeightSynchronizer):
    """Refit SGLang engines that share the trainer's devices, through tensor handles.

    Args:
        source: where the buckets come from: a ``PolicyLike`` in this process
            (``weight_source()`` is read on every refit) or a :class:`BucketSource` (trainer
            ranks as Ray actors: :class:`~refit_sglang.ray_gather.RayTrainerRanks`).
        clients: the engines.
        refit_timeout_s: deadline of one refit; every engine call is bounded by what is left.
        options: tuning.

    Raises:
        ValueError: a deadline with a client whose calls cannot be bounded (in-process).
        UnsupportedEngineError: an in-process engine that lacks a route or field refit needs.
    """

    def __init__(
        self,
        source: PolicyLike | BucketSource,
        clients: Sequence[SGLangClient],
        *,
        refit_timeout_s: float | None = None,
        options: ColocatedOptions | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        if not clients:
            raise ValueError("need at least one SGLang engine")
        if refit_timeout_s is not None:
            require_bounded(clients)
        for client in clients:
            client.require(ROUTES)
        self._options = options or ColocatedOptions()
        self.source = (
            source
            if isinstance(source, BucketSource)
            else LocalBuckets(source, self._options.device)
        )
        """Where the buckets come from."""
        self._clients = tuple(clients)

    @property
    def clients(self) -> tuple[SGLangClient, ...]:
        """The engines, in the order they were given."""
        return self._clients

    def _init_communicator(self, deadline: Deadline) -> None:
        """Nothing to connect: handles are made per bucket."""

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        options = self._options
        started = time.monotonic()
        nbytes = buckets = 0
        progress = _Progress(self._clients)
        with paused(
            self._clients, options.pause_mode, deadline, options.control_timeout_s
        ) as closed:
            try:
                copies = sum(client.tp_size for client in self._clients)
                with closing(
                    self.source.payloads(options.bucket_size_bytes, copies, deadline)
                ) as payloads:
                    for payload in payloads:
                        deadline.check(f"bucket {buckets} of version {version}")
                        self._send(payload, version, deadline, progress)
                        nbytes += payload.nbytes
                        buckets += 1
            except Exception as exc:
                closed.update(progress.closed())
                if isinstance(exc, RefitError):
                    exc.engines = progress.reports(self.version, version)
                raise
            moved = time.monotonic()
            flush_caches(self._clients, deadline, options.control_timeout_s)
        finished = time.monotonic()
        logger.info(
            "version %d: %d buckets, %d B in %.3f s", version, buckets, nbytes, finished - started
        )
        return RefitResult(
            version=version,
            timings_s={"transfer": moved - started, "flush": finished - moved},
            total_s=finished - started,
            wire_bytes=nbytes,
            dense_bytes=nbytes,
            workers=tuple(WorkerOutcome(c.label, True, version) for c in self._clients),
        )

    def _send(
        self, payload: Payload, version: int, deadline: Deadline, progress: _Progress
    ) -> None:
        """Hand ``payload`` to every engine, each rank its own serialization (the buffer
        lives until the source moves on); the last bucket carries ``version``."""
        start = 0
        for client in self._clients:
            own = payload.serialized[start : start + client.tp_size]
            start += client.tp_size
            body: dict[str, object] = {
                "serialized_named_tensors": list(own),
                "load_format": "flattened_bucket",
                "flush_cache": False,
            }
            if payload.last:
                body["weight_version"] = str(version)
            with progress.sending(client, payload.last):
                client.call(
                    "update_weights_from_tensor",
                    body,
                    deadline.timeout_for(self._options.control_timeout_s),
                )

    def _shutdown(self) -> None:
        self.source.close()
        for client in self._clients:
            client.close()


class _Progress:
    """How far each engine got in one refit, and what that leaves it serving on a failure.

    An engine that took no bucket serves its previous version; one that took every bucket
    (the last carries the version) serves the new one. One that took some, or whose update
    call failed (SGLang loads a bucket tensor by tensor and says its weights are then
    partially updated), holds mixed weights: it stays paused (closed) until a complete
    refit. One whose call got no answer may still be inside it (unknown, wedged).
    """

    def __init__(self, clients: Sequence[SGLangClient]) -> None:
        self._clients = tuple(clients)
        self._taken = dict.fromkeys(self._clients, 0)
        self._finished: set[SGLangClient] = set()
        self._failed: dict[SGLangClient, RefitError] = {}

    @contextmanager
    def sending(self, client: SGLangClient, last: bool) -> Iterator[None]:
        """Count one bucket into ``client`` once its call answered; note a failed call."""
        try:
            yield
        except RefitError as exc:
            self._failed[client] = exc
            raise
        self._taken[client] += 1
        if last:
            self._finished.add(client)

    def _state(self, client: SGLangClient) -> EngineState:
        failure = self._failed.get(client)
        if isinstance(failure, RefitTimeoutError):
            return EngineState.UNKNOWN
        if failure is not None:
            return EngineState.CLOSED
        if client in self._finished:
            return EngineState.NEW
        return EngineState.OLD if self._taken[client] == 0 else EngineState.CLOSED

    def closed(self) -> list[SGLangClient]:
        """Engines that must stay paused."""
        old_or_new = (EngineState.OLD, EngineState.NEW)
        return [c for c in self._clients if self._state(c) not in old_or_new]

    def reports(self, previous: int, target: int) -> tuple[EngineReport, ...]:
        """One report per engine (shard = its index in the synchronizer's clients)."""
        versions = {EngineState.OLD: previous, EngineState.NEW: target}
        reports = []
        for shard, client in enumerate(self._clients):
            state = self._state(client)
            failure = self._failed.get(client)
            if failure is not None:
                reason: str | None = str(failure)
            elif state is EngineState.CLOSED:
                reason = f"took {self._taken[client]} buckets before the refit failed"
            else:
                reason = None
            reports.append(EngineReport(shard, client.label, state, versions.get(state), reason))
        return tuple(reports)
