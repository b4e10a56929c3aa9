"""The sparse refit synchronizer: producer shards stream deltas into the relay tree.

Each refit: finish whatever a relay still holds open (``reconcile``), compare every relay's
version with the trainer's committed one (any difference, or no baseline yet: a dense
resync), let every shard stream its payloads concurrently (each rooted at its own relay),
flush every relay, and commit or abort everywhere. Trackers commit their baselines only after
the relays committed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from refit_core.deadline import Deadline
from refit_core.errors import RefitError, RefitTimeoutError
from refit_core.protocols import PolicyLike
from refit_core.synchronizer import WeightSynchronizer
from refit_core.types import NamedTensor, RefitResult, WorkerOutcome
from refit_zmq.codec import tensor_digest
from refit_zmq.relay import (
    CurveConfig,
    ProducerShard,
    RelayCoordinator,
    RelayTuning,
    TransferOptions,
    TransferResult,
    run_transfer,
)
from refit_zmq.relay.auth import api_key_from_env
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

__all__ = ["API_KEY_ENV", "ZmqSparseOptions", "ZmqSparseWeightSynchronizer"]

logger = logging.getLogger(__name__)

API_KEY_ENV = "REFIT_ZMQ_API_KEY"
"""The environment variable the factory's synchronizer takes the API key from, when set."""

_MiB = 1 << 20


@dataclass(frozen=True)
class ZmqSparseOptions:
    """How the synchronizer streams.

    Attributes:
        api_key_env_var: the environment variable holding the API key (None: no key).
        shard_count: producer shards (each encodes its share, rooted at its own relay).
        bucket_size_bytes: dense bytes per payload at most.
        call_timeout_s: longest wait for one reply (also bounded by the refit's deadline).
        verification_candidates: entries each receiver re-reads per payload (0: none).
        verify_digests: also compare every receiver's digests with the trainer's before
            committing (one more pass over the weights on each side).
        tuning: fan-out, chunk size, retries.
        curve: the relays' CURVE public key, when they encrypt.
    """

    api_key_env_var: str | None = None
    shard_count: int = 1
    bucket_size_bytes: int = 64 * _MiB
    call_timeout_s: float = 30.0
    verification_candidates: int = 64
    verify_digests: bool = False
    tuning: RelayTuning = field(default_factory=RelayTuning)
    curve: CurveConfig | None = None

    @classmethod
    def from_env(cls, *, bucket_size_bytes: int | None = None) -> ZmqSparseOptions:
        """Defaults, with the API key variable and CURVE keys taken from the environment."""
        key_var = API_KEY_ENV if os.environ.get(API_KEY_ENV) else None
        bucket = bucket_size_bytes or cls.bucket_size_bytes
        return cls(api_key_env_var=key_var, bucket_size_bytes=bucket, curve=CurveConfig.from_env())


class ZmqSparseWeightSynchronizer(WeightSynchronizer):
    """Sparse delta refits from a trainer into engines whose workers run relays.

    Args:
        policy: the trainer (its ``weight_source()`` is read once per shard per refit).
        relays: the relay addresses, one per engine worker, in a stable order (index ``i`` is
            engine shard ``i`` for ``reconcile_communicator``).
        refit_timeout_s: deadline of one refit (None disarms).
        options: shards, bucket size, verification, security.
        on_commit: called with the version once every relay committed it, for engines whose
            relay writes a copy that must then be loaded (vLLM); its error fails the refit.
    """

    def __init__(
        self,
        policy: PolicyLike,
        relays: Callable[[], Sequence[str]],
        *,
        refit_timeout_s: float | None = None,
        options: ZmqSparseOptions | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        self._policy = policy
        self._relays = relays
        self._on_commit = on_commit
        self._options = options or ZmqSparseOptions()
        self._coordinator: RelayCoordinator | None = None
        self._shards: list[ProducerShard] = []
        self._stale = False

    # -- hooks ---------------------------------------------------------------------------

    def _init_communicator(self, deadline: Deadline) -> None:
        options = self._options
        self._coordinator = RelayCoordinator(
            api_key=api_key_from_env(options.api_key_env_var),
            timeout_s=self._call_timeout(deadline),
            tuning=options.tuning,
            curve=options.curve,
        )
        self._coordinator.configure_tree(list(self._relays()))
        spec = self._policy.weight_source().state_dict_info()
        item_bytes = max(1, min(options.bucket_size_bytes, options.tuning.max_inflight_bytes) // 2)
        for rank in range(options.shard_count):
            config = TrackerConfig(
                shard_rank=rank,
                shard_count=options.shard_count,
                bucket_size_bytes=2 * item_bytes,
                max_item_bytes=item_bytes,
            )
            tracker = DeltaCompressionTracker(spec, config)
            self._shards.append(ProducerShard(tracker, self._tensors))

    def _tensors(self) -> Iterator[NamedTensor]:
        return self._policy.weight_source().iter_tensors()

    def _call_timeout(self, deadline: Deadline) -> float:
        """One reply's timeout: the configured one, within what the deadline leaves."""
        retries = self._options.tuning.retries + 1
        left = deadline.remaining_s()
        call = self._options.call_timeout_s
        return call if left is None else max(0.05, min(call, left / (2 * retries)))

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        coordinator = self._coordinator
        assert coordinator is not None
        started = time.monotonic()
        coordinator.timeout_s = self._call_timeout(deadline)
        statuses = coordinator.reconcile()
        unreachable = sorted(a for a, s in statuses.items() if isinstance(s, RefitError))
        if unreachable:
            self._stale = True
            raise RefitTimeoutError(
                f"relays {unreachable} do not answer; reconcile_communicator without them"
            )
        committed = self._shards[0].tracker.version
        behind = sorted(
            a
            for a, s in statuses.items()
            if isinstance(s, dict) and (committed is None or s["version"] != committed.value)
        )
        if behind and committed is not None:
            logger.warning("relays %s are not at version %d: dense resync", behind, committed.value)
        deadline.check("streaming the refit")
        options = self._options
        try:
            result = run_transfer(
                coordinator,
                self._shards,
                target_version=version,
                resync=bool(behind),
                options=TransferOptions(
                    options.api_key_env_var,
                    self._call_timeout(deadline),
                    options.tuning,
                    options.curve,
                    options.verification_candidates,
                ),
                expected_digests=self._digests() if options.verify_digests else None,
            )
        except RefitTimeoutError:
            self._stale = True  # a relay stopped answering: the tree needs reconciling
            raise
        if self._on_commit is not None:
            self._on_commit(version)
        return self._result(version, result, time.monotonic() - started, resync=bool(behind))

    def _digests(self) -> dict[str, int]:
        return {
            named.name: tensor_digest(named.tensor)
            for named in self._policy.weight_source().iter_tensors()
        }

    def _result(
        self, version: int, result: TransferResult, total_s: float, *, resync: bool
    ) -> RefitResult:
        outcome = result.outcome
        timings = {"stream": result.stream_s, "finish": result.finish_s}
        for address, report in outcome.reports.items():
            timings[f"apply:{address}"] = float(report["apply_s"])
        workers = tuple(
            WorkerOutcome(
                address,
                address not in outcome.decision_errors,
                version,
                outcome.decision_errors.get(address),
            )
            for address in outcome.reports
        )
        logger.info(
            "version %d %s: %d payloads, %d wire bytes",
            version,
            "resynced densely" if resync else "as a delta",
            result.total("payloads"),
            result.total("wire_bytes"),
        )
        return RefitResult(
            version=version,
            timings_s=timings,
            total_s=total_s,
            wire_bytes=result.total("wire_bytes"),
            dense_bytes=result.total("dense_bytes"),
            workers=workers,
            changed_elements=result.total("changed_elements"),
        )

    def _is_stale(self) -> bool:
        return self._stale

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        coordinator = self._coordinator
        assert coordinator is not None
        relays = list(self._relays())
        if any(shard >= len(relays) for shard in absent_shards):
            raise ValueError(f"absent shards {sorted(absent_shards)} of {len(relays)} relays")
        coordinator.timeout_s = self._call_timeout(deadline)
        coordinator.configure_tree([a for i, a in enumerate(relays) if i not in absent_shards])
        self._stale = False

    def _shutdown(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()
        for shard in self._shards:
            shard.tracker.close()
