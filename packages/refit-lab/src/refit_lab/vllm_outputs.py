"""What a vLLM engine generates, in the form refit's checks compare: per prompt, the greedy
tokens and each token's logprob (the engine tier and ``refit bench vllm`` compare refitted
engines with fresh ones through it). vLLM is used through the engine object given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Outputs", "greedy_outputs"]

Outputs = list[tuple[tuple[int, ...], tuple[float, ...]]]
"""Per prompt: greedy token ids and each sampled token's logprob."""


def greedy_outputs(
    llm: Any, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[Outputs, list[int]]:
    """Greedy continuations of ``prompts`` (token ids) with their logprobs, and how many
    prompt tokens the prefix cache served for each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    results = llm.generate(requests, params, use_tqdm=False)
    outputs: Outputs = []
    for result in results:
        completion = result.outputs[0]
        logprobs = tuple(
            step[token].logprob
            for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
        )
        outputs.append((tuple(completion.token_ids), logprobs))
    return outputs, [r.num_cached_tokens or 0 for r in results]
