"""Checkpoints, engines and greedy outputs for the engine tier (imported by its conftest)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refit_core import NamedTensor, StateDictInfo
from refit_core.sources import StateDictSource
from refit_lab.vllm_outputs import Outputs, greedy_outputs

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 64 (vLLM's CPU attention refuses 16), split over 2 ranks
    "num_key_value_heads": 2,
    "vocab_size": 4000,  # 1 MB embeddings: a collective refit takes several 1 MiB buckets
    "max_position_embeddings": 1024,  # the in-flight test generates 600 tokens
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}
TIED = {"tie_word_embeddings": True, "num_hidden_layers": 6}
"""The tied model: deeper than :data:`MODEL`, so that without the output layer's megabyte a
refit still spans several 1 MiB buckets before a trainer that fails part-way stops."""
CHANGED_FRACTION = 0.01
SPARSE_BUCKET_GB = 32 / 1024 / 1024  # 32 KiB of dense input per payload: dozens per refit
PROMPT_TOKENS = 160  # spans full KV blocks, so the prefix cache holds them
NEW_TOKENS = 8


@dataclass
class Checkpoints:
    """Model directories and their tensors: A, B (unrelated), B' and B'' (B, then B', with
    about 1% of elements changed)."""

    paths: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


class PacedSource:
    """A slow trainer: ``source`` with a wait of ``wait_s`` before each tensor it hands out,
    calling ``handing(i)`` before tensor ``i`` (so a test can look in the middle of a
    transfer)."""

    def __init__(
        self, source: StateDictSource, wait_s: float, handing: Callable[[int], None]
    ) -> None:
        self._source = source
        self._wait_s = wait_s
        self._handing = handing

    def state_dict_info(self) -> StateDictInfo:
        return self._source.state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        for i, named in enumerate(self._source.iter_tensors()):
            time.sleep(self._wait_s)
            self._handing(i)
            yield named


class CheckpointPolicy:
    """A ``PolicyLike`` serving whichever checkpoint ``state`` names, paced while ``pace``
    holds a wait and a callback (see :class:`PacedSource`)."""

    def __init__(self, checkpoints: Checkpoints, state: str) -> None:
        self._checkpoints = checkpoints
        self.state = state
        self.pace: tuple[float, Callable[[int], None]] | None = None

    def weight_source(self) -> StateDictSource | PacedSource:
        source = StateDictSource(self._checkpoints.tensors[self.state], dtype="bfloat16")
        return source if self.pace is None else PacedSource(source, *self.pace)


def perturb(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    changed = {}
    for name, tensor in tensors.items():
        mask = torch.rand(tensor.shape, generator=generator) < CHANGED_FRACTION
        noise = torch.randn(tensor.shape, generator=generator) * 0.05
        changed[name] = torch.where(mask, tensor + noise.to(tensor.dtype), tensor)
    return changed


def make_checkpoints(root: Path, *, tied: bool = False) -> Checkpoints:
    """Write A, B, B' and B'' as Hugging Face checkpoints (config + safetensors, no tokenizer);
    ``tied``: the output layer is the embedding (the checkpoint has no ``lm_head.weight``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**MODEL, **(TIED if tied else {})})
    checkpoints = Checkpoints()
    for name, seed in (("A", 1), ("B", 2)):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        checkpoints.tensors[name] = {
            n: t.detach().clone()
            for n, t in model.state_dict().items()
            if not (tied and n == "lm_head.weight")
        }
    checkpoints.tensors["B'"] = perturb(checkpoints.tensors["B"], seed=3)
    checkpoints.tensors["B''"] = perturb(checkpoints.tensors["B'"], seed=4)
    for name, tensors in checkpoints.tensors.items():
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.load_state_dict(tensors, strict=not tied)
        path = root / name.replace("'", "p")
        model.save_pretrained(path)
        checkpoints.paths[name] = str(path)
    return checkpoints


@contextmanager
def worker_binding(tp: int) -> Iterator[None]:
    """vLLM's CPU workers started inside bind to a core each (vLLM's default binding refuses
    two workers on one NUMA node)."""
    if tp == 1:
        yield
        return
    values = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r) for r in range(tp))}
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_engine(path: str, extra: dict[str, Any], tp: int = 1) -> Any:
    """A real vLLM engine on ``path`` (CPU, eager, bf16), ``tp`` tensor-parallel workers (each
    bound to a core of its own)."""
    from vllm import LLM

    with worker_binding(tp):
        return LLM(
            model=path,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=256,
            seed=0,
            tensor_parallel_size=tp,
            **extra,
        )


def reloaded_outputs(llm: Any, path: str) -> Outputs:
    """Outputs after vLLM's own in-place reload of the checkpoint at ``path`` (its
    ``reload_weights``, the path vLLM's own loader takes at start-up)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.reset_prefix_cache()
    return generate(llm)


class FreshOutputs:
    """What a fresh engine generates on a checkpoint at a tensor-parallel size, each engine
    started once per session (alone: shut down before the next starts)."""

    def __init__(self) -> None:
        self._outputs: dict[tuple[str, int], Outputs] = {}

    def __call__(self, path: str, tp: int) -> Outputs:
        if (path, tp) not in self._outputs:
            llm = start_engine(path, {}, tp)
            try:
                self._outputs[path, tp] = generate(llm)
            finally:
                llm.llm_engine.engine_core.shutdown()
        return self._outputs[path, tp]


@dataclass
class Engine:
    """A session's engine and what vLLM itself generates on each checkpoint.

    Attributes:
        llm: the engine.
        tp: its tensor-parallel size.
        expected: state -> outputs: the start state's from the engine fresh, the others from
            fresh engines (:class:`FreshOutputs`) or, for an untied model, after vLLM's own
            reload from disk (checked to reproduce the fresh outputs exactly).
    """

    llm: Any
    tp: int
    expected: dict[str, Outputs]
    version: int = 0

    def next_version(self) -> int:
        """A version above every one this engine's receivers saw."""
        self.version += 1
        return self.version


@contextmanager
def running_engine(
    checkpoints: Checkpoints, extra: dict[str, Any], tp: int, fresh: FreshOutputs | None = None
) -> Iterator[Engine]:
    """An engine fresh on B' for a test module, shut down after it."""
    engine = open_engine(checkpoints, extra, tp, "B'", fresh)
    try:
        yield engine
    finally:
        engine.llm.llm_engine.engine_core.shutdown()


def open_engine(
    checkpoints: Checkpoints,
    extra: dict[str, Any],
    tp: int,
    start: str,
    fresh: FreshOutputs | None = None,
) -> Engine:
    """An engine fresh on ``start``, with what vLLM generates on every other checkpoint: fresh
    engines' outputs (``fresh``: needed for a tied model, which vLLM's own reload leaves on
    its old output layer), else its own reload's."""
    if fresh is not None:
        others = {s: fresh(checkpoints.paths[s], tp) for s in ("A", "B''") if s != start}
    llm = start_engine(checkpoints.paths[start], extra, tp)
    expected = {start: generate(llm)}
    if fresh is not None:
        expected.update(others)
        assert len(set(map(str, expected.values()))) == len(expected), "states must differ"
        return Engine(llm, tp, expected)
    for state in ("A", "B''"):
        if state != start:
            expected[state] = reloaded_outputs(llm, checkpoints.paths[state])
    assert reloaded_outputs(llm, checkpoints.paths[start]) == expected[start], (
        "vLLM's own reload must reproduce a fresh engine exactly"
    )
    assert len(set(map(str, expected.values()))) == len(expected), "states must differ"
    return Engine(llm, tp, expected)


class Pending:
    """One ``generate`` call running on a thread (an engine closed by a failed refit must hold
    it, neither aborted nor answered, until a complete refit reopens it)."""

    def __init__(self, llm: Any) -> None:
        self._result: list[Outputs] = []
        self._thread = threading.Thread(target=lambda: self._result.append(generate(llm)))
        self._thread.start()

    def answered_within(self, wait_s: float) -> bool:
        """Whether it finished within ``wait_s``."""
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def outputs(self, timeout_s: float = 120.0) -> Outputs:
        started = time.monotonic()
        self._thread.join(timeout_s)
        assert self._result, f"no answer within {time.monotonic() - started:.0f} s"
        return self._result[0]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randint(1, MODEL["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(3)
    ]


def generate(llm: Any, *, expect_cached: bool | None = None) -> Outputs:
    """Greedy outputs of the tier's prompts; with ``expect_cached`` also check whether the
    prefix cache served part of them."""
    outputs, cached = greedy_outputs(llm, _prompts(), NEW_TOKENS)
    if expect_cached is not None:
        assert (min(cached) > 0) == expect_cached, f"cached prompt tokens: {cached}"
    return outputs


def factory_synchronizer(
    policy: CheckpointPolicy, generation: Any, timeout_s: float, **options: Any
) -> Any:
    """The factory's vLLM synchronizer from ``policy`` into ``generation``, trainer and engines
    on this host, as a framework builds it (``options``: the factory's other keywords); a
    context manager."""
    from refit_core import create_weight_synchronizer
    from refit_lab.ray_cluster import LocalCluster

    return create_weight_synchronizer(
        policy,
        generation,
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_timeout_s=timeout_s,
        **options,
    )


def sparse_synchronizer(policy: CheckpointPolicy, relays: Any, timeout_s: float) -> Any:
    """The factory's zmq_sparse synchronizer from ``policy`` into ``relays`` (a relay
    generation); a context manager."""
    return factory_synchronizer(
        policy,
        relays,
        timeout_s,
        refit_buffer_size_gb=SPARSE_BUCKET_GB,
        transport="zmq_sparse",
    )
