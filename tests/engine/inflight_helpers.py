"""Requests in flight on a real vLLM ``AsyncLLM`` while refit stages and commits (the engine
tier's refit-while-serving tests, one module per row)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from engine_helpers import MODEL, CheckpointPolicy, worker_binding

from refit_core.vllm import AsyncVllm
from refit_lab.async_engine import async_engine
from refit_lab.event_loop import EventLoopThread

IN_FLIGHT = 8
PROMPT_TOKENS = 16
NEW_TOKENS = 600  # long enough that a refit lands inside every request
PACED_WAIT_S = 0.05  # the slowed trainer's wait before each tensor it hands out
PACED_FROM, PACED_TO = 2, 20  # the engine must generate between these tensors of a staging

Tokens = tuple[int, ...]
Spans = list[tuple[str, int, int]]


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


def prompts(seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, MODEL["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(IN_FLIGHT)
    ]


def drop_prefix_cache(served: Served) -> None:
    """So that every prefill below computes its whole prompt, as the requests in flight did."""
    served.loop.run(served.engine.reset_prefix_cache())


def greedy(served: Served, prompts: list[list[int]], new_tokens: list[int]) -> list[Tokens]:
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

    drop_prefix_cache(served)

    async def every() -> list[Tokens]:
        calls = [
            one(p, n, f"greedy-{time.monotonic_ns()}-{i}")
            for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))
        ]
        return list(await asyncio.gather(*calls))

    return served.loop.run(every())


@contextmanager
def serving(path: str, extra: dict[str, Any], tp: int = 1) -> Iterator[Served]:
    """An ``AsyncLLM`` on ``path`` with ``tp`` workers, serving on a loop of its own."""
    with worker_binding(tp), async_engine(path, extra, tp=tp) as (engine, loop):
        yield Served(engine, CountingAsyncVllm(engine, loop.loop), loop)


def switch_index(request: Finished, old: int) -> int:
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


def check_requests_cross_a_commit(
    served: Served, synchronizer: Any, policy: CheckpointPolicy, state: str
) -> None:
    """Eight requests generate while the policy's next ``state`` is staged, from a trainer
    slowed down so that the transfer lasts: the engine makes progress in its middle and is
    never paused. Eight others are in flight across the commit, one pause. Each finishes whole
    on one switch, and the tokens after it are the new weights' own."""
    assert synchronizer.supports_staging
    version = synchronizer.version
    drop_prefix_cache(served)
    during = InFlight(served, prompts(seed=10), "staging")
    during.wait_until_every_request_has(4)
    pauses = served.client.pauses
    policy.state = state
    middle: dict[int, int] = {}  # tensor handed out -> tokens generated by then

    def handing(i: int) -> None:
        if i in (PACED_FROM, PACED_TO):
            middle.setdefault(i, sum(during.progress))

    policy.pace = (PACED_WAIT_S, handing)
    try:
        staged = synchronizer.stage_weights()
    finally:
        policy.pace = None
    assert served.client.pauses == pauses, "staging does not pause the engine"
    assert middle[PACED_TO] > middle[PACED_FROM], "the engine generated while it received"

    crossing = prompts(seed=11)
    across = InFlight(served, crossing, "commit")  # still generating when the commit lands
    across.wait_until_every_request_has(4)
    result = synchronizer.commit_weights(staged)
    assert served.client.pauses == pauses + 1
    assert result.version == version + 1
    assert 0 < result.timings_s["pause"] < result.total_s, result.timings_s

    for request in during.finished():
        switch_index(request, version)
    finished = across.finished()
    switches = [switch_index(request, version) for request in finished]
    assert all(4 <= k < NEW_TOKENS for k in switches), switches
    continued = greedy(
        served,
        [p + list(f.tokens[:k]) for p, f, k in zip(crossing, finished, switches, strict=True)],
        [NEW_TOKENS - k for k in switches],
    )
    after = [f.tokens[k:] for f, k in zip(finished, switches, strict=True)]
    assert after == continued, "tokens after the switch are the new weights' own"


@contextmanager
def served_as_without_a_refit(served: Served, synchronizer: Any) -> Iterator[None]:
    """Eight requests in flight through the failed stagings the body runs: no pause, nothing
    staged, the version unmoved, and every request's tokens exactly the served version's."""
    version = synchronizer.version
    label = served.client.weight_version()
    asked = prompts(seed=12)
    expected = greedy(served, asked, [NEW_TOKENS] * IN_FLIGHT)  # no refit at all
    drop_prefix_cache(served)
    requests = InFlight(served, asked, "failed")
    requests.wait_until_every_request_has(4)
    pauses = served.client.pauses
    yield
    assert served.client.pauses == pauses, "a failed staging never pauses the engine"
    assert synchronizer.staged is None and synchronizer.version == version
    finished = requests.finished()
    assert [f.tokens for f in finished] == expected, "exactly the served version's tokens"
    assert all(f.spans == [(label, 0, NEW_TOKENS)] for f in finished)
    assert served.client.weight_version() == label
