"""The colocated SGLang synchronizer: flattened buckets handed over as tensor handles.

Each bucket is flattened into a buffer the engine can map (shared memory on CPU, CUDA IPC on
GPU) by a :class:`~refit_sglang.sources.BucketSource` (one in-process policy, or trainer ranks
gathering to the engine's first rank through Ray), passed to every engine's
``update_weights_from_tensor`` with ``load_format="flattened_bucket"`` (one payload copy per
tensor-parallel rank), and released as soon as every engine has answered. The last bucket carries the weight version; the cache is
flushed before generation continues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass

from refit_core import RefitResult, WeightSynchronizer, WorkerOutcome
from refit_core.backend import Deadline, PolicyLike
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
        check_pause_mode(self.pause_mode)
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
        with paused(self._clients, options.pause_mode, deadline, options.control_timeout_s):
            with closing(self.source.payloads(options.bucket_size_bytes, deadline)) as payloads:
                for payload in payloads:
                    deadline.check(f"bucket {buckets} of version {version}")
                    self._send(payload, str(version) if payload.last else None, deadline)
                    nbytes += payload.nbytes
                    buckets += 1
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

    def _send(self, payload: Payload, weight_version: str | None, deadline: Deadline) -> None:
        """Hand ``payload`` to every engine (its buffer lives until the source moves on)."""
        for client in self._clients:
            body: dict[str, object] = {
                "serialized_named_tensors": [payload.serialized] * client.tp_size,
                "load_format": "flattened_bucket",
                "flush_cache": False,
            }
            if weight_version is not None:
                body["weight_version"] = weight_version
            client.call(
                "update_weights_from_tensor",
                body,
                deadline.timeout_for(self._options.control_timeout_s),
            )

    def _shutdown(self) -> None:
        self.source.close()
        for client in self._clients:
            client.close()
