"""Refit while serving, on a real vLLM ``AsyncLLM`` (the zmq_sparse row, tensor-parallel 1).

Eight greedy requests stay in flight while the next version is staged (streamed, verified and
held beside the model by the worker's relay; the engine keeps generating) and committed (the
engine pauses in vLLM's ``keep`` mode, writes the held deltas, drops its KV, labels the
version and resumes). Every request then finishes with all its tokens, tagged by vLLM's own
``weight_versions`` with one switch, and its tokens after the switch are exactly what the
engine generates on the new weights when given the same prefix. A failure while staging (a
corrupted payload, a relay cut off mid-transfer) leaves the engine serving its version with no
pause at all: the requests in flight finish exactly as without a refit.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from engine_helpers import MODEL, CheckpointPolicy, Checkpoints, sparse_synchronizer

from refit_core import EngineState, RefitError, WeightSynchronizer
from refit_core.vllm import AsyncVllm
from refit_lab.zmq_faults import CorruptingRelayProxy, PartitioningRelayProxy, ProxiedRelays

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

_T = TypeVar("_T")

IN_FLIGHT = 8
PROMPT_TOKENS = 16
NEW_TOKENS = 600  # long enough that a refit lands inside every request
DEADLINE_S = 60.0
CUT_DEADLINE_S = 10.0  # the refit that loses its relay waits this long

Tokens = tuple[int, ...]
Spans = list[tuple[str, int, int]]


class EventLoopThread:
    """The application's event loop, serving the engine from a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, call: Coroutine[Any, Any, _T], timeout_s: float = 300.0) -> _T:
        return asyncio.run_coroutine_threadsafe(call, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)


class CountingAsyncVllm(AsyncVllm):
    """The engine as refit drives it, counting the pauses refit asks for."""

    pauses = 0

    def pause(self) -> None:
        self.pauses += 1
        super().pause()


@dataclass
class Served:
    engine: Any
    client: CountingAsyncVllm
    loop: EventLoopThread


@dataclass(frozen=True)
class Finished:
    tokens: Tokens
    spans: Spans
    finish_reason: str | None


class InFlight:
    """Greedy requests streaming on the engine's loop; how many tokens each has so far."""

    def __init__(self, served: Served, prompts: list[list[int]], tag: str) -> None:
        self.progress = [0] * len(prompts)
        self._futures = [
            asyncio.run_coroutine_threadsafe(
                self._stream(served.engine, prompt, f"{tag}-{i}", i), served.loop.loop
            )
            for i, prompt in enumerate(prompts)
        ]

    async def _stream(self, engine: Any, prompt: list[int], request_id: str, i: int) -> Finished:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False
        )
        last = None
        async for output in engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, request_id
        ):
            last = output.outputs[0]
            self.progress[i] = len(last.token_ids)
        assert last is not None
        spans = [(s.version, s.start, s.end) for s in last.weight_versions or []]
        return Finished(tuple(last.token_ids), spans, last.finish_reason)

    def wait_until_every_request_has(self, tokens: int, timeout_s: float = 120.0) -> None:
        started = time.monotonic()
        while min(self.progress) < tokens:
            assert time.monotonic() - started < timeout_s, f"progress {self.progress}"
            time.sleep(0.01)

    def finished(self, timeout_s: float = 300.0) -> list[Finished]:
        return [future.result(timeout_s) for future in self._futures]


def _prompts(seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, MODEL["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(IN_FLIGHT)
    ]


def _drop_prefix_cache(served: Served) -> None:
    """So that every prefill below computes its whole prompt, as the requests in flight did."""
    served.loop.run(served.engine.reset_prefix_cache())


def _greedy(served: Served, prompts: list[list[int]], new_tokens: list[int]) -> list[Tokens]:
    """Each prompt's greedy continuation of its own length, all submitted together (the
    prefix cache dropped first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def one(prompt: list[int], count: int, request_id: str) -> Tokens:
        params = SamplingParams(
            temperature=0.0, max_tokens=count, ignore_eos=True, detokenize=False
        )
        last = None
        async for output in served.engine.generate(
            TokensPrompt(prompt_token_ids=prompt), params, request_id
        ):
            last = output.outputs[0]
        assert last is not None
        return tuple(last.token_ids)

    _drop_prefix_cache(served)

    async def every() -> list[Tokens]:
        calls = [
            one(p, n, f"greedy-{time.monotonic_ns()}-{i}")
            for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))
        ]
        return list(await asyncio.gather(*calls))

    return served.loop.run(every())


@pytest.fixture(scope="module")
def served(checkpoints: Checkpoints) -> Iterator[Served]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from refit_zmq.vllm import engine_args

    loop = EventLoopThread()
    arguments = AsyncEngineArgs(
        model=checkpoints.paths["B'"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        **engine_args(),
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(arguments)

    async def stop(engine: Any) -> None:
        engine.shutdown()  # on its loop, so that its output task ends before the loop does
        await asyncio.sleep(0.1)

    engine = loop.run(start())
    try:
        yield Served(engine, CountingAsyncVllm(engine, loop.loop), loop)
    finally:
        loop.run(stop(engine))
        loop.close()


@pytest.fixture(scope="module")
def generation(served: Served) -> Any:
    from refit_zmq.vllm import VllmRelayGeneration

    return VllmRelayGeneration([served.client], relay_timeout_s=20.0)


@pytest.fixture(scope="module")
def partition(generation: Any) -> Iterator[PartitioningRelayProxy]:
    proxy = PartitioningRelayProxy(generation.relay_addresses()[0])
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def corrupt(partition: PartitioningRelayProxy) -> Iterator[CorruptingRelayProxy]:
    proxy = CorruptingRelayProxy(partition.address)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def policy(checkpoints: Checkpoints) -> CheckpointPolicy:
    return CheckpointPolicy(checkpoints, "B'")


@pytest.fixture(scope="module")
def synchronizer(
    generation: Any, corrupt: CorruptingRelayProxy, policy: CheckpointPolicy
) -> Iterator[WeightSynchronizer]:
    with sparse_synchronizer(
        policy, ProxiedRelays(generation, corrupt), DEADLINE_S
    ) as synchronizer:
        synchronizer.sync_weights(1)  # the first refit: a dense resync to the bits it serves
        yield synchronizer


def _switch_index(request: Finished, old: int) -> int:
    """Where ``request`` switched from version ``old`` to ``old + 1`` (its length: never);
    checks that it finished whole and that its spans cover every token with one switch."""
    assert request.finish_reason == "length", "no request was aborted"
    assert len(request.tokens) == NEW_TOKENS
    versions = [version for version, _, _ in request.spans]
    assert versions in ([str(old)], [str(old), str(old + 1)]), request.spans
    bounds = [(start, end) for _, start, end in request.spans]
    assert bounds[0][0] == 0 and bounds[-1][1] == NEW_TOKENS, request.spans
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), request.spans
    return bounds[1][0] if len(bounds) == 2 else NEW_TOKENS


def test_requests_in_flight_cross_a_commit_and_switch_weights_once(
    served: Served, synchronizer: WeightSynchronizer, policy: CheckpointPolicy
) -> None:
    assert synchronizer.supports_staging
    version = synchronizer.version
    _drop_prefix_cache(served)
    during = InFlight(served, _prompts(seed=10), "staging")
    during.wait_until_every_request_has(4)
    pauses = served.client.pauses
    policy.state = "B''"
    before = sum(during.progress)
    staged = synchronizer.stage_weights()
    assert served.client.pauses == pauses, "staging does not pause the engine"
    assert sum(during.progress) > before, "the engine generated while the version was staged"

    prompts = _prompts(seed=11)
    across = InFlight(served, prompts, "commit")  # still generating when the commit lands
    across.wait_until_every_request_has(4)
    result = synchronizer.commit_weights(staged)
    assert served.client.pauses == pauses + 1
    assert result.version == version + 1
    assert 0 < result.timings_s["pause"] < result.total_s, result.timings_s

    for request in during.finished():
        _switch_index(request, version)
    finished = across.finished()
    switches = [_switch_index(request, version) for request in finished]
    assert all(4 <= k < NEW_TOKENS for k in switches), switches
    continued = _greedy(
        served,
        [p + list(f.tokens[:k]) for p, f, k in zip(prompts, finished, switches, strict=True)],
        [NEW_TOKENS - k for k in switches],
    )
    after = [f.tokens[k:] for f, k in zip(finished, switches, strict=True)]
    assert after == continued, "tokens after the switch are the new weights' own"


def test_a_failure_while_staging_leaves_the_served_version_and_never_pauses(
    served: Served,
    synchronizer: WeightSynchronizer,
    policy: CheckpointPolicy,
    corrupt: CorruptingRelayProxy,
    partition: PartitioningRelayProxy,
) -> None:
    version = synchronizer.version
    served_label = served.client.weight_version()
    prompts = _prompts(seed=12)
    expected = _greedy(served, prompts, [NEW_TOKENS] * IN_FLIGHT)  # no refit at all
    _drop_prefix_cache(served)
    requests = InFlight(served, prompts, "failed")
    requests.wait_until_every_request_has(4)
    pauses = served.client.pauses
    policy.state = "B'"

    corrupt.arm()
    with pytest.raises(RefitError, match="checksum") as corrupted:
        synchronizer.stage_weights()
    assert corrupt.corrupted == 1
    assert [e.state for e in corrupted.value.engines] == [EngineState.OLD]

    partition.partition_after(2)  # the relay is cut off mid-transfer, the abort included
    synchronizer.refit_timeout_s = CUT_DEADLINE_S
    started = time.monotonic()
    try:
        with pytest.raises(RefitError) as cut:
            synchronizer.stage_weights()
    finally:
        synchronizer.refit_timeout_s = DEADLINE_S
    assert time.monotonic() - started < CUT_DEADLINE_S + 2.0, "released by the deadline"
    assert cut.value.failed_shards == (0,)
    partition.heal()

    assert served.client.pauses == pauses, "a failed staging never pauses the engine"
    assert synchronizer.staged is None and synchronizer.version == version
    finished = requests.finished()
    assert [f.tokens for f in finished] == expected, "exactly the served version's tokens"
    assert all(f.spans == [(served_label, 0, NEW_TOKENS)] for f in finished)
    assert served.client.weight_version() == served_label

    synchronizer.recover()  # the relay that was cut off finishes its transfer; a retry works
    staged = synchronizer.stage_weights()
    synchronizer.commit_weights(staged)
    assert served.client.weight_version() == str(staged.version)
