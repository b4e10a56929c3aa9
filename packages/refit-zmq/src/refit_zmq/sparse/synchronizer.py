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
from dataclasses import dataclass, field, replace
from typing import TypeVar

from refit_core import (
    DeadlineTooShortError,
    EngineHealth,
    EngineReport,
    EngineState,
    EngineStatus,
    FleetStatus,
    RefitError,
    RefitResult,
    RefitTimeoutError,
    StagedRefit,
    WeightSynchronizer,
    WorkerError,
    WorkerOutcome,
)
from refit_core.backend import Deadline, Participant, check_field_types, gather, probe_timeout_s
from refit_zmq.relay import (
    CurveConfig,
    PreparedTransfer,
    RelayCoordinator,
    RelayStatus,
    RelayTuning,
    ShardProducerRole,
    TransferOptions,
    TransferResult,
    decide_transfer,
    prepare_transfer,
)
from refit_zmq.relay.coordinator.coordinator import (
    attempt_timeout_s as relay_attempt_timeout_s,
)
from refit_zmq.relay.coordinator.outcome import relay_error
from refit_zmq.relay.wire.auth import api_key_from_env
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
        call_timeout_s: longest wait for one reply of a relay or a producer. Within a refit
            each control request to the relays (the STATUS probe that starts every refit,
            OUTCOME, COMMIT, ABORT, CONFIGURE) waits at most
            ``min(call_timeout_s, refit_timeout_s / (2 * (tuning.retries + 1)))`` per
            attempt, so that all attempts of the probe take at most half the deadline; a
            relay that does not answer the probe is reported unreachable (``unknown``).
        probe_timeout_s: how long ``status()`` and ``recover()`` wait for each relay's STATUS
            answer (every relay asked at once, once; one that does not answer in time is
            ``unreachable``, and its next probe starts on a fresh connection). None derives
            it from the deadline: a tenth of ``refit_timeout_s``, within [1 s, 2 s]
            (2 s without a deadline). A value above a quarter of ``refit_timeout_s`` is
            refused when the synchronizer is built.
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
    probe_timeout_s: float | None = None
    verification_candidates: int = 64
    verify_digests: bool = False
    tuning: RelayTuning = field(default_factory=RelayTuning)
    curve: CurveConfig | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {self.call_timeout_s}")
        probe_timeout_s(self.probe_timeout_s, None, name="probe_timeout_s")

    def probe_s(self, refit_timeout_s: float | None) -> float:
        """The timeout of the STATUS probe of ``status()`` and ``recover()`` under a refit
        deadline of ``refit_timeout_s``.

        Raises:
            ValueError: ``probe_timeout_s`` is above a quarter of the deadline (a fleet
                with a frozen relay could then not be asked and recovered within it).
        """
        return probe_timeout_s(self.probe_timeout_s, refit_timeout_s, name="probe_timeout_s")

    @classmethod
    def from_env(cls, *, bucket_size_bytes: int | None = None) -> ZmqSparseOptions:
        """Defaults, with the API key variable and CURVE keys taken from the environment."""
        key_var = API_KEY_ENV if os.environ.get(API_KEY_ENV) else None
        bucket = bucket_size_bytes or cls.bucket_size_bytes
        return cls(api_key_env_var=key_var, bucket_size_bytes=bucket, curve=CurveConfig.from_env())


def attempt_timeout_s(options: ZmqSparseOptions, deadline_left_s: float | None) -> float:
    """How long one attempt of a control request within a refit (the STATUS probe that starts
    every refit among them) waits for its reply: ``call_timeout_s``, within what the deadline
    leaves for all ``tuning.retries + 1`` attempts to take at most half of it (at least
    0.05 s): the coordinator's own rule at these options. The README's figures are this
    function's, at the defaults."""
    return relay_attempt_timeout_s(options.call_timeout_s, options.tuning.retries, deadline_left_s)


class ZmqSparseWeightSynchronizer(WeightSynchronizer):
    """Sparse delta refits from a trainer into engines whose workers run relays.

    Two-phase refits (``stage_weights``, then ``commit_weights`` or ``abort_weights``) need
    engines whose relays hold the writes aside until the commit (``on_commit`` given: vLLM's
    workers): staging streams and prepares the transfer on every relay while the engines
    serve; committing delivers COMMIT to every relay and calls ``on_commit``; aborting
    delivers ABORT, which drops the held writes. Meanwhile the producers' trackers keep the
    transfer pending, so an abort costs the next refit nothing (it is again a delta).

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

    supports_staging = True

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
        self._probe_s = self._options.probe_s(refit_timeout_s)
        self._coordinator: RelayCoordinator | None = None
        self._shards: dict[str, int] = {}
        self._stale = False
        self._prepared: dict[str, tuple[PreparedTransfer, bool, float]] = {}

    @property
    def options(self) -> ZmqSparseOptions:
        """The options this synchronizer runs with."""
        return self._options

    # -- hooks ---------------------------------------------------------------------------

    def _control(self) -> RelayCoordinator:
        """The coordinator (made on first use: status may be asked before the first refit);
        every request takes the deadline of the call it serves."""
        if self._coordinator is None:
            options = self._options
            self._coordinator = RelayCoordinator(
                api_key=api_key_from_env(options.api_key_env_var),
                timeout_s=options.call_timeout_s,
                tuning=options.tuning,
                curve=options.curve,
            )
        return self._coordinator

    def _init_communicator(self, deadline: Deadline) -> None:
        options = self._options
        coordinator = self._control()
        addresses = list(self._relays())
        self._shards = {address: shard for shard, address in enumerate(addresses)}
        coordinator.configure_tree(addresses, deadline=deadline)
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
            within_call_timeout=False,  # builds the tracker: compiles its kernel (seconds)
        )

    def _on_producers(
        self,
        method: str,
        start: Callable[[Participant[ShardProducerRole], int], Future[_T]],
        deadline: Deadline,
        *,
        count: int | None = None,
        engines: Sequence[EngineReport] = (),
        within_call_timeout: bool = True,
    ) -> list[_T]:
        """Call ``method`` (``start(producer, rank)``) on the first ``count`` producers
        (default: all) within the deadline, and each reply within ``call_timeout_s`` unless
        ``within_call_timeout`` is False (a call that does real work); their answers, in rank
        order.

        Raises:
            RefitTimeoutError: a producer did not answer (named as wedged), with ``engines``.
            WorkerError: a producer failed (a dead trainer rank), with ``engines``.
        """
        producers = self._producers[:count]
        calls = {p: start(p, rank) for rank, p in enumerate(producers)}
        reply_s = self._options.call_timeout_s if within_call_timeout else None
        gathered = gather(calls, deadline.timeout_for(reply_s))
        if gathered.missing:
            labels = [p.label for p in gathered.missing]
            raise RefitTimeoutError(
                f"producers {labels} did not answer {method}",
                wedged_workers=labels,
                engines=engines,
            )
        for participant, error in gathered.errors.items():
            if isinstance(error, RefitError):
                error.engines = error.engines or tuple(engines)
                raise error
            lines = str(error).strip().splitlines()
            raise WorkerError(
                f"{type(error).__name__}: {lines[0][:300] if lines else ''}",
                worker=participant.label,
                operation=method,
                engines=engines,
            ) from error
        return [gathered.results[p] for p in producers]

    def _call_timeout(self, deadline: Deadline) -> float:
        """One reply's timeout (the STATUS probe's among them), see :func:`attempt_timeout_s`."""
        return attempt_timeout_s(self._options, deadline.remaining_s())

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        started = time.monotonic()
        try:
            prepared, resync = self._prepare(version, deadline)
        except RefitTimeoutError as error:
            too_short = self._too_short(f"refit to version {version}", error, started, deadline)
            if too_short is None:
                raise
            raise too_short from error
        return self._commit(prepared, version, deadline, started=started, resync=resync)

    def _too_short(
        self, what: str, error: RefitTimeoutError, started: float, deadline: Deadline
    ) -> DeadlineTooShortError | None:
        """The error to raise instead of ``error`` when the deadline passed although nothing
        failed: every relay of the tree confirmed the abort (none is ``unknown``) and every
        producer answered (one still encoding at the deadline must answer a ping now), so
        the transfer needs more time than the deadline gives it. None otherwise."""
        if self.refit_timeout_s is None or not deadline.expired():
            return None
        if not error.engines or any(e.state is EngineState.UNKNOWN for e in error.engines):
            return None
        late = [p for p in self._producers if p.label in error.wedged_workers]
        if (
            late
            and not gather(
                {p: p.call(ShardProducerRole.refit_version) for p in late}, self._probe_s
            ).ok
        ):
            return None
        return DeadlineTooShortError.measured(
            what,
            deadline_s=self.refit_timeout_s,
            elapsed_s=time.monotonic() - started,
            progress=error.progress,
            engines=error.engines,
        )

    def _stage_weights(self, version: int, deadline: Deadline) -> StagedRefit:
        """Phase one on every relay: streamed, verified and prepared beside what each engine
        serves (a vLLM worker's relay holds the writes aside; the model is not touched)."""
        if self._on_commit is None:
            raise NotImplementedError(
                f"{type(self).__name__} cannot stage for these engines: their relays apply "
                "payloads in place (an EngineRelay), so a transfer changes what they serve; "
                "engines whose relays hold the writes aside (vLLM's) can"
            )
        started = time.monotonic()
        prepared, resync = self._prepare(version, deadline)
        self._prepared[prepared.transfer_id] = (prepared, resync, started)
        flushed = TransferResult(
            prepared.flushed, prepared.shards, prepared.stream_s, prepared.flush_s
        )
        staged = self._result(version, flushed, time.monotonic() - started, resync=resync)
        return StagedRefit(version, prepared.transfer_id, staged)

    def _commit_staged(self, staged: StagedRefit, deadline: Deadline) -> RefitResult:
        prepared, resync, started = self._prepared.pop(staged.staging_id)
        return self._commit(prepared, staged.version, deadline, started=started, resync=resync)

    def _abort_staged(self, staged: StagedRefit, deadline: Deadline) -> None:
        prepared, _, _ = self._prepared.pop(staged.staging_id)
        coordinator = self._control()
        result = decide_transfer(
            coordinator,
            self._producers,
            prepared,
            commit=False,
            options=self._transfer_options(deadline),
            deadline=deadline,
        )
        missed = sorted(result.outcome.decision_errors)
        if missed:  # they abort it with their peers, or the next refit's reconcile does
            logger.warning("relays %s did not confirm the abort of %s", missed, staged.staging_id)
            self._stale = True

    def _prepare(self, version: int, deadline: Deadline) -> tuple[PreparedTransfer, bool]:
        """Phase one of a refit to ``version``: finish what a relay still holds open, pick
        delta or dense resync, stream and flush; the prepared transfer and whether it
        resyncs.

        Raises:
            RefitError: nothing was prepared anywhere (the transfer was aborted).
        """
        coordinator = self._coordinator
        assert coordinator is not None
        statuses = coordinator.close_open_transfers(deadline=deadline)
        unreachable = {a: s for a, s in statuses.items() if isinstance(s, RefitError)}
        versions = {a: s.version for a, s in statuses.items() if isinstance(s, RelayStatus)}
        if unreachable:
            self._stale = True
            raise relay_error(
                "the status probe before the refit", unreachable, self._tree_shards(), versions
            )
        untouched = tuple(
            EngineReport(self._tree_shards()[a], a, EngineState.OLD, v) for a, v in versions.items()
        )
        baselines = set(
            self._on_producers(
                "refit_version",
                lambda producer, _: producer.call(ShardProducerRole.refit_version),
                deadline,
                engines=untouched,
            )
        )
        committed = baselines.pop() if len(baselines) == 1 else None
        behind = sorted(a for a, v in versions.items() if v != committed)
        if behind and committed is not None:
            logger.warning("relays %s are not at version %s: dense resync", behind, committed)
        if deadline.expired():
            raise RefitTimeoutError(
                f"refit to version {version}: the deadline passed before streaming began",
                engines=untouched,
            )
        expected = (
            self._on_producers(
                "refit_digests",
                lambda producer, _: producer.call(ShardProducerRole.refit_digests),
                deadline,
                count=1,
                engines=untouched,
            )[0]
            if self._options.verify_digests
            else None
        )
        try:
            prepared = prepare_transfer(
                coordinator,
                self._producers,
                target_version=version,
                resync=bool(behind),
                options=self._transfer_options(deadline),
                expected_digests=expected,
                deadline=deadline,
                shards=self._tree_shards(),
            )
        except RefitError as error:
            # a relay or producer stopped answering: rebuild before the next refit
            self._stale |= isinstance(error, RefitTimeoutError) or bool(error.wedged_workers)
            raise
        return prepared, bool(behind)

    def _commit(
        self,
        prepared: PreparedTransfer,
        version: int,
        deadline: Deadline,
        *,
        started: float,
        resync: bool,
    ) -> RefitResult:
        """Phase two: commit on every relay, then let the engines serve it (``on_commit``).

        Timings add ``transfer`` (streaming, flush and decision) and ``pause`` (the time in
        ``on_commit``, which bounds every engine's pause: vLLM engines pause there)."""
        result = decide_transfer(
            self._control(),
            self._producers,
            prepared,
            commit=True,
            options=self._transfer_options(deadline),
            deadline=deadline,
        )
        serving = time.monotonic()
        if self._on_commit is not None:
            self._on_commit(version)
        done = time.monotonic()
        refit = self._result(version, result, done - started, resync=resync)
        moved = {"transfer": result.stream_s + result.finish_s, "pause": done - serving}
        return replace(refit, timings_s={**refit.timings_s, **moved})

    def _transfer_options(self, deadline: Deadline) -> TransferOptions:
        options = self._options
        return TransferOptions(
            options.api_key_env_var,
            self._call_timeout(deadline),
            options.tuning,
            options.curve,
            options.verification_candidates,
        )

    def _tree_shards(self) -> dict[str, int]:
        """Relay address -> shard index, for the relays of the tree."""
        assert self._coordinator is not None
        return {a: self._shards.get(a, i) for i, a in enumerate(self._coordinator.relays)}

    def _result(
        self, version: int, result: TransferResult, total_s: float, *, resync: bool
    ) -> RefitResult:
        outcome = result.outcome
        timings = {"stream": result.stream_s, "finish": result.finish_s}
        for address, report in outcome.reports.items():
            timings[f"apply:{address}"] = report.apply_s
        workers = tuple(
            WorkerOutcome(
                address,
                address not in outcome.decision_errors,
                version,
                None
                if address not in outcome.decision_errors
                else str(outcome.decision_errors[address]),
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

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """Every relay's engine, left-out relays included: serving its committed version,
        closed while a transfer holds part of its bytes, or unreachable."""
        relays = list(self._relays())
        statuses = self._control().status(relays=relays, deadline=deadline, probe_s=self._probe_s)
        return FleetStatus(
            tuple(_engine_status(shard, a, statuses.get(a)) for shard, a in enumerate(relays))
        )

    def _close_open_transfers(self, deadline: Deadline) -> None:
        self._control().close_open_transfers(deadline=deadline)

    def live_shards(self) -> frozenset[int] | None:
        if self._coordinator is None:
            return None
        return frozenset(self._tree_shards().values())

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        coordinator = self._coordinator
        assert coordinator is not None
        relays = list(self._relays())
        if any(shard >= len(relays) for shard in absent_shards):
            raise ValueError(f"absent shards {sorted(absent_shards)} of {len(relays)} relays")
        self._shards = {address: shard for shard, address in enumerate(relays)}
        coordinator.configure_tree(
            [a for i, a in enumerate(relays) if i not in absent_shards],
            deadline=deadline,
            shards=self._shards,
        )
        self._stale = False

    def _shutdown(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()
        calls = {p: p.call(ShardProducerRole.refit_close) for p in self._producers}
        gather(calls, self._options.call_timeout_s)
        for producer in self._producers:
            producer.close()


def _engine_status(
    shard: int, address: str, status: RelayStatus | Exception | None
) -> EngineStatus:
    """One relay's engine as its STATUS answer tells (no answer: unreachable)."""
    if not isinstance(status, RelayStatus):
        detail = "no answer" if status is None else f"{type(status).__name__}: {status}"
        return EngineStatus(shard, address, EngineHealth.UNREACHABLE, detail=detail[:200])
    if status.open is not None:
        return EngineStatus(
            shard,
            address,
            EngineHealth.CLOSED,
            staged_version=status.open.target,
            detail=f"transfer {status.open.transfer_id} holds part of its bytes",
            began_version=status.began,
        )
    return EngineStatus(
        shard, address, EngineHealth.SERVING, status.version or 0, began_version=status.began
    )
