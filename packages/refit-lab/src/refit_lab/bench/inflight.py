"""Bench `inflight`: refit while serving, staged against stop-the-world, in the same run.

A fleet of reference engines (Ray actors on a local Ray cluster, one process each) decodes
without a break: client threads (:class:`~refit_lab.serving_load.ServingLoad`) submit requests
back to back. A :class:`~refit_lab.trainer.SimulatedTrainer` steps before every refit, and the refits
alternate, in interleaved rounds, between two modes of the same collective synchronizer
(refit-nccl over gloo):

- ``staged``: ``stage_weights()`` while the engines generate, then ``commit_weights()``;
- ``stop_the_world``: ``sync_weights()``, streamed: each engine pauses at its first bucket
  and serves again at the commit, so it pauses for the whole transfer (NeMo-RL's recipe).

**Pause** (the headline): observed in the engines. Each records, on the host's monotonic
clock, when ``on_refit_begin`` returned (the step in progress ended, the engine is held) and
when ``on_refit_commit`` released it; a refit's pause is the longest such span over the
engines, the time some engine could produce no token because the refit held it.

**Token gap** (reported beside it): each engine also records when it generated every token;
a refit's token gap is, over the engines, the stretch from the last token before its pause to
the first after. It adds to the pause the step in progress when the pause was asked and the
KV cache the reference engine recomputes, one token per step, for the requests in flight
under the new weights: costs of this engine, the same in both modes.

**Throughput**: the fleet's tokens per second while staging against a window without any
refit just before it, in the same round. Every request must come back complete (each prompt
all its tokens, its version spans covering them) and every engine must hold the trainer's
weights bit for bit after every refit.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    BenchUnavailableError,
    machine_info,
    median_ratio,
)
from refit_lab.reference_engine import ReferenceModelConfig, checkpoint_tensor_specs
from refit_lab.serving_load import ServingCounts, ServingLoad

if TYPE_CHECKING:
    from refit_core import WeightSynchronizer
    from refit_lab.bench.inflight_workers import EngineTimeline, InflightFleet, PauseSpan
    from refit_lab.trainer import SimulatedTrainer

logger = logging.getLogger(__name__)

MiB = 1 << 20
SEED = 19
STARTUP_S = 300.0
CALL_TIMEOUT_S = 120.0
REFIT_TIMEOUT_S = 120.0
MODES = ("staged", "stop_the_world")


@dataclass(frozen=True)
class Sizes:
    """One run's shape: fleet, model, interleaved rounds (one refit of each mode per round)
    and the refit-free window measured before each staging."""

    engines: int
    config: ReferenceModelConfig
    rounds: int
    quiet_s: float


QUICK = Sizes(
    engines=3,
    config=ReferenceModelConfig(
        vocab_size=8192,
        hidden_size=768,
        num_layers=6,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        max_seq_len=64,
    ),
    rounds=4,
    quiet_s=1.0,
)
FULL = Sizes(
    engines=3,
    config=ReferenceModelConfig(
        vocab_size=16384,
        hidden_size=1024,
        num_layers=10,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        max_seq_len=64,
    ),
    rounds=7,
    quiet_s=2.0,
)


def state_bytes(config: ReferenceModelConfig) -> int:
    """Bytes of the model's checkpoint (what every refit moves to every engine)."""
    elements = sum(math.prod(shape) for shape, _ in checkpoint_tensor_specs(config).values())
    return elements * config.torch_dtype.itemsize


@dataclass(frozen=True)
class RefitRecord:
    """One measured refit: its mode, round and version, and driver times (monotonic s):
    ``started``, ``staged`` (staging done; None when streamed), ``finished``, the refit-free
    window ``quiet`` before a staging, and the synchronizer's own pause (staged only)."""

    mode: str
    round: int
    version: int
    started: float
    staged: float | None
    finished: float
    quiet: tuple[float, float] | None
    synchronizer_pause_s: float | None
    bitexact: bool


def _pause_spans(timelines: Sequence[EngineTimeline], version: int) -> list[tuple[int, PauseSpan]]:
    spans = [
        (index, span)
        for index, timeline in enumerate(timelines)
        for span in timeline.pauses
        if span.version == version
    ]
    if len(spans) != len(timelines):
        raise RuntimeError(f"version {version}: {len(spans)} pauses on {len(timelines)} engines")
    return spans


def pause_s(timelines: Sequence[EngineTimeline], version: int) -> float:
    """The longest pause of any engine for the refit to ``version``."""
    return max(span.end - span.start for _, span in _pause_spans(timelines, version))


def token_gap_s(timelines: Sequence[EngineTimeline], version: int) -> float:
    """The longest stretch, over the engines, from the last token before the pause of the
    refit to ``version`` to the first token after it."""
    gaps = []
    for index, span in _pause_spans(timelines, version):
        times = timelines[index].token_times
        before = bisect.bisect_right(times, span.start)
        after = bisect.bisect_left(times, span.end)
        if before == 0 or after == len(times):
            raise RuntimeError(f"engine {index}: no token on both sides of pause {version}")
        gaps.append(times[after] - times[before - 1])
    return max(gaps)


def tokens_per_s(timelines: Sequence[EngineTimeline], start: float, end: float) -> float:
    """The fleet's tokens per second between ``start`` and ``end``."""
    tokens = sum(
        bisect.bisect_right(t.token_times, end) - bisect.bisect_left(t.token_times, start)
        for t in timelines
    )
    return tokens / (end - start)


class _Refits:
    """Runs the measured refits over a serving fleet and records each."""

    def __init__(
        self,
        trainer: SimulatedTrainer,
        synchronizer: WeightSynchronizer,
        fleet: InflightFleet,
        quiet_s: float,
    ) -> None:
        self._trainer = trainer
        self._synchronizer = synchronizer
        self._fleet = fleet
        self._quiet_s = quiet_s

    def bitexact(self) -> bool:
        """Every engine holds the trainer's weights, bit for bit."""
        from refit_lab.digest import state_digest

        expected = state_digest(self._trainer.engine_state().items())
        return all(d == expected for d in self._fleet.call("state_digests"))

    def run(self, mode: str, round_index: int) -> RefitRecord:
        """A trainer step, then one refit in ``mode``."""
        self._trainer.step()
        quiet = staged_at = synchronizer_pause = None
        if mode == "staged":
            quiet_start = time.monotonic()
            time.sleep(self._quiet_s)
            quiet = (quiet_start, time.monotonic())
            started = time.monotonic()
            staged = self._synchronizer.stage_weights()
            staged_at = time.monotonic()
            result = self._synchronizer.commit_weights(staged)
            synchronizer_pause = result.timings_s["pause"]
        else:
            started = time.monotonic()
            result = self._synchronizer.sync_weights()
        finished = time.monotonic()
        logger.info(
            "%s refit to version %d: %.3f s (staging %s)",
            mode,
            result.version,
            finished - started,
            "-" if staged_at is None else f"{staged_at - started:.3f} s",
        )
        return RefitRecord(
            mode,
            round_index,
            result.version,
            started,
            staged_at,
            finished,
            quiet,
            synchronizer_pause,
            self.bitexact(),
        )


def _wait_for_tokens_after(fleet: InflightFleet, moment: float, within_s: float) -> None:
    """Return once every engine generated a token after ``moment``."""
    end = time.monotonic() + within_s
    while not all(t.token_times and t.token_times[-1] > moment for t in fleet.call("timeline")):
        if time.monotonic() > end:
            raise TimeoutError(f"an engine generated nothing for {within_s:.0f} s")
        time.sleep(0.05)


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: :data:`QUICK` or :data:`FULL`."""
    return measure(ctx, QUICK if ctx.quick else FULL)


def measure(ctx: BenchContext, sizes: Sizes) -> BenchReport:
    """Stand up the fleet, warm it up (one streamed and one staged refit), start serving,
    run ``sizes.rounds`` rounds of both modes (their order alternating), then report."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise BenchUnavailableError(f"ray is not installed: {exc}") from None
    from refit_core import create_weight_synchronizer
    from refit_core.backend import CollectiveSenderSpec
    from refit_lab.bench import inflight_workers
    from refit_lab.ray_cluster import LocalCluster, local_ray
    from refit_lab.reference_engine import random_checkpoint
    from refit_lab.trainer import SimulatedTrainer

    steps = 3 + 2 * sizes.rounds
    done = 0

    def progress(message: str) -> None:
        nonlocal done
        ctx.progress(message, done / steps)
        done += 1

    records: list[RefitRecord] = []
    with ExitStack() as stack:
        progress(f"local Ray cluster and {sizes.engines} engines")
        stack.enter_context(
            local_ray(sizes.engines + 1, object_store_memory=128 * MiB, log_to_driver=False)
        )
        fleet = inflight_workers.InflightFleet(
            sizes.config,
            sizes.engines,
            seed=SEED,
            geometry=CollectiveSenderSpec("refit", 4 * MiB, 4),
            startup_s=STARTUP_S,
            timeout_s=CALL_TIMEOUT_S,
        )
        stack.callback(fleet.close)
        trainer = SimulatedTrainer(random_checkpoint(sizes.config, SEED), seed=SEED, lr=1e-3)
        synchronizer = create_weight_synchronizer(
            trainer,
            fleet,
            "vllm",
            False,
            train_cluster=LocalCluster(1),
            inference_cluster=LocalCluster(sizes.engines),
            refit_timeout_s=REFIT_TIMEOUT_S,
        )
        stack.enter_context(synchronizer)
        refits = _Refits(trainer, synchronizer, fleet, sizes.quiet_s)
        progress("warm-up: one streamed and one staged refit")
        synchronizer.sync_weights()
        synchronizer.commit_weights(synchronizer.stage_weights())
        exact = refits.bitexact()
        load = ServingLoad(fleet.workers, sizes.config.vocab_size, seed=SEED)
        load.start()
        stack.callback(load.stop)
        _wait_for_tokens_after(fleet, time.monotonic(), STARTUP_S)
        for round_index in range(sizes.rounds):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                progress(f"round {round_index + 1}/{sizes.rounds}: {mode}")
                records.append(refits.run(mode, round_index))
        _wait_for_tokens_after(fleet, records[-1].finished, CALL_TIMEOUT_S)
        load.stop()
        timelines: list[EngineTimeline] = fleet.call("timeline")
    return _report(ctx, sizes, records, load.counts, exact, timelines)


def _report(
    ctx: BenchContext,
    sizes: Sizes,
    records: list[RefitRecord],
    counts: ServingCounts,
    warm_exact: bool,
    timelines: list[EngineTimeline],
) -> BenchReport:
    nbytes = state_bytes(sizes.config)
    results: list[dict[str, object]] = []
    by_round: dict[int, dict[str, dict[str, float]]] = {}
    for record in records:
        moving_end = record.staged if record.staged is not None else record.finished
        row: dict[str, float] = {
            "pause_ms": 1e3 * pause_s(timelines, record.version),
            "token_gap_ms": 1e3 * token_gap_s(timelines, record.version),
            "moving_tokens_per_s": tokens_per_s(timelines, record.started, moving_end),
        }
        if record.quiet is not None:
            row["quiet_tokens_per_s"] = tokens_per_s(timelines, *record.quiet)
            if not row["quiet_tokens_per_s"]:
                raise RuntimeError(f"round {record.round + 1}: no token without a refit")
        by_round.setdefault(record.round, {})[record.mode] = row
        results.append(
            {
                "case": f"round {record.round + 1} {record.mode}",
                "mode": record.mode,
                "version": record.version,
                "engines": sizes.engines,
                "nbytes": nbytes,
                "refit_s": record.finished - record.started,
                "moving_s": moving_end - record.started,
                **row,
                "synchronizer_pause_ms": (
                    "" if record.synchronizer_pause_s is None else 1e3 * record.synchronizer_pause_s
                ),
                "bitexact": record.bitexact,
            }
        )
    rounds = list(by_round.values())

    def median(key: str, mode: str) -> float:
        return statistics.median(r[mode][key] for r in rounds)

    def paired(*, subject: tuple[str, str], reference: tuple[str, str]) -> float:
        """The median over rounds of ``round[mode][key]`` of the subject over the reference's,
        each given as ``(mode, key)``."""
        return median_ratio(
            [r[subject[0]][subject[1]] for r in rounds],
            [r[reference[0]][reference[1]] for r in rounds],
        )

    summary: dict[str, float | bool] = {
        "pause_fraction_of_stop_the_world": paired(
            subject=("staged", "pause_ms"), reference=("stop_the_world", "pause_ms")
        ),
        "staged_pause_ms": median("pause_ms", "staged"),
        "stop_the_world_pause_ms": median("pause_ms", "stop_the_world"),
        "token_gap_fraction_of_stop_the_world": paired(
            subject=("staged", "token_gap_ms"), reference=("stop_the_world", "token_gap_ms")
        ),
        "staged_token_gap_ms": median("token_gap_ms", "staged"),
        "stop_the_world_token_gap_ms": median("token_gap_ms", "stop_the_world"),
        "tokens_during_staging_fraction": paired(
            subject=("staged", "moving_tokens_per_s"), reference=("staged", "quiet_tokens_per_s")
        ),
        "staging_tokens_per_s": median("moving_tokens_per_s", "staged"),
        "no_refit_tokens_per_s": median("quiet_tokens_per_s", "staged"),
        "requests_submitted": counts.submitted,
        "requests_lost": counts.lost,
        "bitexact": warm_exact and all(r.bitexact for r in records),
    }
    ctx.progress("inflight done", 1.0)
    return BenchReport(
        bench="inflight",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary=summary,
    )
