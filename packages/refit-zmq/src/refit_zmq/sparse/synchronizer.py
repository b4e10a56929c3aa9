"""The sparse refit synchronizer: producer shards stream deltas into the relay tree.

Producers are the trainer ranks (:class:`~refit_zmq.relay.ShardProducer` on Ray actors) or,
for a single-process trainer, ``shard_count`` producers in the controller's process. Each
refit: finish whatever a relay still holds open (``reconcile``), compare every relay's version
with every producer's baseline (any difference, or no baseline yet: a dense resync), let every
producer stream its shard concurrently (each rooted at its own relay), flush every relay, and
commit or abort everywhere. Producers commit their baselines only after the relays committed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from refit_core import (
    RefitError,
    RefitResult,
    RefitTimeoutError,
    WeightSynchronizer,
    WorkerError,
    WorkerOutcome,
)
from refit_core.backend import Deadline, Participant, gather
from refit_zmq.relay import (
    CurveConfig,
    RelayCoordinator,
    RelayTuning,
    ShardProducerRole,
    TransferOptions,
    TransferResult,
    run_transfer,
)
from refit_zmq.relay.auth import api_key_from_env
from refit_zmq.tracker import TrackerConfig

__all__ = ["API_KEY_ENV", "ZmqSparseOptions", "ZmqSparseWeightSynchronizer"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

API_KEY_ENV = "REFIT_ZMQ_API_KEY"
"""The environment variable the factory's synchronizer takes the API key from, when set."""

_MiB = 1 << 20


@dataclass(frozen=True)
class ZmqSparseOptions:
    """How the synchronizer streams.

    Attributes:
        api_key_env_var: the environment variable holding the API key (None: no key).
        shard_count: producer shards of a single-process trainer (each encodes its share,
            rooted at its own relay); trainer ranks on Ray are one shard each.
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
        producers: one participant per shard, in shard order, each reaching a
            :class:`~refit_zmq.relay.ShardProducer` (a trainer rank's Ray actor, or an object
            in this process).
        relays: the relay addresses, one per engine worker, in a stable order (index ``i`` is
            engine shard ``i`` for ``reconcile_communicator``).
        refit_timeout_s: deadline of one refit (None disarms).
        options: bucket size, verification, security.
        on_commit: called with the version once every relay committed it, for engines whose
            relay writes a copy that must then be loaded (vLLM); its error fails the refit.
    """

    def __init__(
        self,
        producers: Sequence[Participant[ShardProducerRole]],
        relays: Callable[[], Sequence[str]],
        *,
        refit_timeout_s: float | None = None,
        options: ZmqSparseOptions | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        if not producers:
            raise ValueError("need at least one producer")
        self._producers = list(producers)
        self._relays = relays
        self._on_commit = on_commit
        self._options = options or ZmqSparseOptions()
        self._coordinator: RelayCoordinator | None = None
        self._stale = False

    @property
    def options(self) -> ZmqSparseOptions:
        """The options this synchronizer runs with."""
        return self._options

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
        item_bytes = max(1, min(options.bucket_size_bytes, options.tuning.max_inflight_bytes) // 2)
        count = len(self._producers)
        self._on_producers(
            "refit_init",
            lambda producer, rank: producer.call(
                ShardProducerRole.refit_init,
                TrackerConfig(
                    shard_rank=rank,
                    shard_count=count,
                    bucket_size_bytes=2 * item_bytes,
                    max_item_bytes=item_bytes,
                ),
            ),
            deadline,
        )

    def _on_producers(
        self,
        method: str,
        start: Callable[[Participant[ShardProducerRole], int], Future[_T]],
        deadline: Deadline,
        *,
        count: int | None = None,
    ) -> list[_T]:
        """Call ``method`` (``start(producer, rank)``) on the first ``count`` producers
        (default: all) within the deadline; their answers, in rank order.

        Raises:
            RefitTimeoutError: a producer did not answer (named as wedged).
            WorkerError: a producer failed (a dead trainer rank).
        """
        producers = self._producers[:count]
        calls = {p: start(p, rank) for rank, p in enumerate(producers)}
        gathered = gather(calls, deadline.timeout_for(self._options.call_timeout_s))
        if gathered.missing:
            labels = [p.label for p in gathered.missing]
            raise RefitTimeoutError(f"{method}: no answer from {labels}", wedged_workers=labels)
        for participant, error in gathered.errors.items():
            if isinstance(error, RefitError):
                raise error
            raise WorkerError(str(error), worker=participant.label, operation=method) from error
        return [gathered.results[p] for p in producers]

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
        baselines = set(
            self._on_producers(
                "refit_version",
                lambda producer, _: producer.call(ShardProducerRole.refit_version),
                deadline,
            )
        )
        committed = baselines.pop() if len(baselines) == 1 else None
        behind = sorted(
            a for a, s in statuses.items() if isinstance(s, dict) and s["version"] != committed
        )
        if behind and committed is not None:
            logger.warning("relays %s are not at version %s: dense resync", behind, committed)
        deadline.check("streaming the refit")
        options = self._options
        expected = (
            self._on_producers(
                "refit_digests",
                lambda producer, _: producer.call(ShardProducerRole.refit_digests),
                deadline,
                count=1,
            )[0]
            if options.verify_digests
            else None
        )
        try:
            result = run_transfer(
                coordinator,
                self._producers,
                target_version=version,
                resync=bool(behind),
                options=TransferOptions(
                    options.api_key_env_var,
                    self._call_timeout(deadline),
                    options.tuning,
                    options.curve,
                    options.verification_candidates,
                ),
                expected_digests=expected,
                wait_s=deadline.remaining_s(),
            )
        except RefitTimeoutError:
            self._stale = True  # a relay or producer stopped answering
            raise
        if self._on_commit is not None:
            self._on_commit(version)
        return self._result(version, result, time.monotonic() - started, resync=bool(behind))

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
        calls = {p: p.call(ShardProducerRole.refit_close) for p in self._producers}
        gather(calls, self._options.call_timeout_s)
        for producer in self._producers:
            producer.close()
