"""What a vLLM engine generates, in the form refit's checks compare: per prompt, the greedy
tokens and each token's logprob (the engine tier and ``refit bench vllm`` / ``lora`` compare
refitted engines with fresh ones through it), from an offline ``LLM`` or an ``AsyncLLM``. vLLM
is used through the engine object given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Outputs", "greedy_each", "greedy_one", "greedy_outputs"]

Outputs = list[tuple[tuple[int, ...], tuple[float, ...]]]
"""Per prompt: greedy token ids and each sampled token's logprob."""


def greedy_outputs(
    llm: Any, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[Outputs, list[int]]:
    """Greedy continuations of ``prompts`` (token ids) with their logprobs, and how many
    prompt tokens the prefix cache served for each.

    Each prompt is generated alone: vLLM's CPU kernels compute a row of a batch slightly
    differently depending on where it sits, and a request's place in the batch changes from
    call to call, so batched outputs of one engine on the same weights differed between calls
    (logprobs by about 1e-4), while one request at a time they are the same every time.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, detokenize=False)
    results = [
        llm.generate([TokensPrompt(prompt_token_ids=list(p))], params, use_tqdm=False)[0]
        for p in prompts
    ]
    outputs: Outputs = []
    for result in results:
        completion = result.outputs[0]
        logprobs = tuple(
            step[token].logprob
            for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
        )
        outputs.append((tuple(completion.token_ids), logprobs))
    return outputs, [r.num_cached_tokens or 0 for r in results]


async def greedy_one(
    engine: Any,
    prompt: Sequence[int],
    new_tokens: int,
    *,
    lora_request: Any = None,
    progress: list[int] | None = None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """One prompt's greedy continuation of exactly ``new_tokens`` tokens and their logprobs, on
    an ``AsyncLLM`` (``progress`` gets the count of tokens after every step)."""
    import uuid

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )
    last = None
    async for output in engine.generate(
        TokensPrompt(prompt_token_ids=list(prompt)),
        params,
        uuid.uuid4().hex,
        lora_request=lora_request,
    ):
        last = output.outputs[0]
        if progress is not None:
            progress.append(len(last.token_ids))
    if last is None:
        raise RuntimeError("the engine produced no output")
    tokens = tuple(last.token_ids)
    return tokens, tuple(s[t].logprob for t, s in zip(tokens, last.logprobs, strict=True))


async def greedy_each(
    engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int, *, lora_request: Any = None
) -> Outputs:
    """:func:`greedy_one` of each prompt, one after the other: every step a batch of one, so
    the sums (and logprobs) never depend on which requests happened to share a step."""
    return [
        await greedy_one(engine, prompt, new_tokens, lora_request=lora_request)
        for prompt in prompts
    ]
