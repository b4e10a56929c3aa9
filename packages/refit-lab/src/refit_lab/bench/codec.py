"""Bench `codec`: the sparse delta codec against memcpy and the peers' delta recipes.

The state is transformer-shaped bf16 (embedding, qkv, o, gate_up, down, norms): about 65 MiB
quick, 517 MiB full, or ``--bytes N``. Deltas come from simulated optimizer steps
(:mod:`refit_lab.bench.deltas`) with learning rates calibrated so that about 0.1%, 1%, 5% and
30% of the bf16 elements change. A last case changes 1% of the elements at uniformly random
positions to random bits.

Every case runs rounds; in each round every method runs once, right after its own memcpy of
the dense bytes: the codec (tracker encode with the checksum inside, apply with undo
recording), the slime/SkyRL recipe (XOR + zstd-1 + xxh3-128), the NeMo-RL recipe (gaps +
torch.save + zstd-1 + BLAKE2b-128) and the straightforward numpy delta the issue calibrates
its targets with. Every ratio is the median of per-round ratios (method against the memcpy
just before it, or against the other method in the same round), and the reference's own
median rate is recorded beside it. Rates are dense input bytes per second.

The ceiling, last in every round after its own memcpy: ``read_both``, both versions read once
and nothing else (:class:`~refit_lab.bench.read_both.ReadBoth`), which any change detection
must do; ``ceiling_fraction_of_memcpy`` is what it reaches, ``encode_fraction_of_ceiling``
how close the codec's encode gets to it.

``--device cuda`` runs :mod:`refit_lab.bench.codec_gpu` instead (the GPU delta encoder).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refit_core import TensorSpec, WeightVersion
from refit_lab.bench.deltas import (
    ModelShape,
    State,
    Trajectory,
    calibrate_lr,
    same_bits,
    simulate_adamw,
    state_bytes,
    uniform_case,
)
from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    machine_info,
    rate_fields,
    timeit,
)
from refit_lab.bench.read_both import ReadBoth
from refit_lab.bench.references import (
    Memcpy,
    nemo_apply,
    nemo_encode,
    numpy_delta_apply,
    numpy_delta_encode,
    xor_zstd_apply,
    xor_zstd_encode,
)
from refit_lab.bench.runtime import torch_threads
from refit_zmq.codec import DeltaPayload, UndoLog, apply_payload
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

__all__ = [
    "ADAMW_FRACTIONS",
    "FULL_MODEL",
    "METHODS",
    "QUICK_MODEL",
    "UNIFORM_CASE",
    "ModelShape",
    "Trajectory",
    "calibrate_lr",
    "measure",
    "measure_case",
    "run",
    "same_bits",
    "simulate_adamw",
    "uniform_case",
]

logger = logging.getLogger(__name__)

ADAMW_FRACTIONS: dict[str, float] = {
    "adamw_0.1pct": 0.001,
    "adamw_1pct": 0.01,
    "adamw_5pct": 0.05,
    "adamw_30pct": 0.30,
}
UNIFORM_CASE = "uniform_1pct"
SUMMARY_CASE = "adamw_1pct"
METHODS = ("refit", "xor_zstd", "nemo", "numpy_naive")
CEILING = "read_both"
"""The ceiling's rows: both versions read once (:class:`~refit_lab.bench.read_both.ReadBoth`)."""
REPEATS = 5

QUICK_MODEL = ModelShape(hidden=1024, intermediate=2816, vocab=8192, layers=2)
FULL_MODEL = ModelShape(hidden=2048, intermediate=5632, vocab=32000, layers=4)


def _restore(receiver: State, old: State) -> None:
    for name, tensor in receiver.items():
        tensor.copy_(old[name])


@dataclass
class _Method:
    """One way to ship a delta: encode (returns wire bytes), apply, and reset the receiver."""

    encode: Callable[[], int]
    apply: Callable[[], None]
    reset: Callable[[], None]


def _refit_method(
    tracker: DeltaCompressionTracker, new: State, receiver: State, old: State
) -> _Method:
    base, target = WeightVersion(0), WeightVersion(1)
    payloads: list[DeltaPayload] = []
    undo = UndoLog()

    def encode() -> int:
        payloads[:] = tracker.encode(new, target)
        tracker.abort()
        return sum(p.nbytes for p in payloads)

    def apply() -> None:
        for payload in payloads:
            apply_payload(payload.frames, receiver, base, undo=undo)

    def reset() -> None:
        undo.restore()
        if not same_bits(receiver, old):
            raise AssertionError("refit undo did not restore the old bits")

    return _Method(encode, apply, reset)


def _recipe_method(
    old: State,
    new: State,
    receiver: State,
    encode_one: Callable[[torch.Tensor, torch.Tensor], tuple[bytes, bytes]],
    apply_one: Callable[[bytes, bytes, torch.Tensor], None],
) -> _Method:
    encoded: list[tuple[str, bytes, bytes]] = []

    def encode() -> int:
        encoded[:] = [(name, *encode_one(old[name], new[name])) for name in old]
        return sum(len(payload) for _, payload, _ in encoded)

    def apply() -> None:
        for name, payload, digest in encoded:
            apply_one(payload, digest, receiver[name])

    return _Method(encode, apply, lambda: _restore(receiver, old))


@dataclass
class _Samples:
    """Timed rounds of one method, each with the memcpy timed right before it."""

    encode_s: list[float] = field(default_factory=list)
    apply_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    wire_bytes: int = 0
    bitexact: bool = True

    def run(
        self, method: _Method, memcpy: Memcpy, new: State, receiver: State, *, record: bool
    ) -> None:
        wire: list[int] = []
        copy_s = memcpy.seconds()
        encode = timeit(lambda: wire.append(method.encode()), repeats=1, warmup=0)
        apply = timeit(method.apply, repeats=1, warmup=0)
        self.wire_bytes = wire[-1]
        self.bitexact = self.bitexact and same_bits(receiver, new)
        method.reset()
        if record:
            self.memcpy_s.append(copy_s)
            self.encode_s.append(encode.min_s)
            self.apply_s.append(apply.min_s)


def _methods(
    tracker: DeltaCompressionTracker, old: State, new: State, receivers: dict[str, State]
) -> dict[str, _Method]:
    scratch = torch.empty(
        max(t.numel() * t.element_size() for t in old.values()), dtype=torch.uint8
    )
    return {
        "refit": _refit_method(tracker, new, receivers["refit"], old),
        "xor_zstd": _recipe_method(
            old,
            new,
            receivers["xor_zstd"],
            lambda a, b: xor_zstd_encode(a, b, out=scratch),
            xor_zstd_apply,
        ),
        "nemo": _recipe_method(old, new, receivers["nemo"], nemo_encode, nemo_apply),
        "numpy_naive": _recipe_method(
            old, new, receivers["numpy_naive"], numpy_delta_encode, numpy_delta_apply
        ),
    }


def measure_case(
    case: str, old: State, new: State, *, threads: int, repeats: int
) -> list[dict[str, object]]:
    """Result rows of one case: every method and memcpy, timed in interleaved rounds."""
    dense = state_bytes(old)
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    receivers = {m: {k: v.clone() for k, v in old.items()} for m in METHODS}
    specs = {name: TensorSpec.of(tensor) for name, tensor in old.items()}
    samples = {m: _Samples() for m in METHODS}
    memcpy = Memcpy(dense, threads=threads)
    ceiling = _Samples()
    with (
        DeltaCompressionTracker(specs, TrackerConfig(threads=threads)) as tracker,
        ReadBoth(old, new, threads=threads) as read_both,
    ):
        tracker.load_baseline(old, WeightVersion(0))
        methods = _methods(tracker, old, new, receivers)
        for round_index in range(repeats + 1):
            for name, method in methods.items():
                samples[name].run(method, memcpy, new, receivers[name], record=round_index > 0)
            copy_s, read_s = memcpy.seconds(), read_both.seconds()
            if round_index > 0:
                ceiling.memcpy_s.append(copy_s)
                ceiling.encode_s.append(read_s)
    refit = samples["refit"]
    rows: list[dict[str, object]] = []
    for name, got in samples.items():
        encode = PairedRatio.of(subject_s=got.encode_s, reference_s=got.memcpy_s, nbytes=dense)
        apply = PairedRatio.of(subject_s=got.apply_s, reference_s=got.memcpy_s, nbytes=dense)
        rows.append(
            {
                "case": case,
                "method": name,
                "changed_fraction": changed / (dense // 2),
                **rate_fields("encode_gbps", encode.subject_rounds_gbps),
                **rate_fields("apply_gbps", apply.subject_rounds_gbps),
                "wire_bytes": got.wire_bytes,
                "wire_vs_dense": got.wire_bytes / dense,
                "encode_vs_memcpy": encode.ratio,
                "apply_vs_memcpy": apply.ratio,
                **rate_fields("memcpy_gbps", encode.reference_rounds_gbps),
                "refit_encode_speedup": PairedRatio.of(
                    subject_s=refit.encode_s, reference_s=got.encode_s, nbytes=dense
                ).ratio,
                "encode_vs_read_both": PairedRatio.of(
                    subject_s=got.encode_s, reference_s=ceiling.encode_s, nbytes=dense
                ).ratio,
                "bitexact": got.bitexact,
            }
        )
    read = PairedRatio.of(subject_s=ceiling.encode_s, reference_s=ceiling.memcpy_s, nbytes=dense)
    rows.append(
        {
            "case": case,
            "method": CEILING,
            **rate_fields("encode_gbps", read.subject_rounds_gbps),
            **rate_fields("memcpy_gbps", read.reference_rounds_gbps),
            "encode_vs_memcpy": read.ratio,
            "differs": read_both.differ,
        }
    )
    all_memcpy = [s for got in [*samples.values(), ceiling] for s in got.memcpy_s]
    rows.append(
        {
            "case": case,
            "method": "memcpy",
            "encode_gbps": dense / statistics.median(all_memcpy) / 1e9,
            "wire_bytes": dense,
        }
    )
    logger.info("codec bench %s: %s", case, rows[0])
    return rows


def _summary(rows: list[dict[str, object]]) -> dict[str, float | bool]:
    at = {r["method"]: r for r in rows if r["case"] == SUMMARY_CASE}

    def num(method: str, key: str) -> float:
        value = at[method][key]
        if not isinstance(value, int | float):
            raise TypeError(f"{key} is not a number: {value!r}")
        return float(value)

    summary: dict[str, float | bool] = {
        "encode_speedup_vs_xor_zstd": num("xor_zstd", "refit_encode_speedup"),
        "encode_speedup_vs_xor_zstd_reference_gbps": num("xor_zstd", "encode_gbps"),
        "wire_ratio_vs_xor_zstd": num("refit", "wire_bytes") / num("xor_zstd", "wire_bytes"),
        "encode_speedup_vs_nemo_recipe": num("nemo", "refit_encode_speedup"),
        "encode_speedup_vs_nemo_recipe_reference_gbps": num("nemo", "encode_gbps"),
        "encode_fraction_of_memcpy": num("refit", "encode_vs_memcpy"),
        "encode_fraction_of_memcpy_reference_gbps": num("refit", "memcpy_gbps"),
        "ceiling_fraction_of_memcpy": num(CEILING, "encode_vs_memcpy"),
        "ceiling_fraction_of_memcpy_reference_gbps": num(CEILING, "memcpy_gbps"),
        "encode_fraction_of_ceiling": num("refit", "encode_vs_read_both"),
        "encode_fraction_of_ceiling_reference_gbps": num(CEILING, "encode_gbps"),
        "apply_fraction_of_memcpy": num("refit", "apply_vs_memcpy"),
        "apply_fraction_of_memcpy_reference_gbps": num("refit", "memcpy_gbps"),
        "roundtrip_bitexact": all(r["bitexact"] for r in rows if "bitexact" in r),
        "encode_speedup_vs_numpy_naive": num("numpy_naive", "refit_encode_speedup"),
        "encode_speedup_vs_numpy_naive_reference_gbps": num("numpy_naive", "encode_gbps"),
        "refit_encode_gbps": num("refit", "encode_gbps"),
        "changed_fraction": num("refit", "changed_fraction"),
    }
    return summary


def measure(
    ctx: BenchContext, *, model: ModelShape, repeats: int = REPEATS, seed: int = 0
) -> BenchReport:
    """Run every case on ``model``'s state, ``repeats`` timed rounds each."""
    with torch_threads(ctx.threads):
        ctx.progress("simulating AdamW moments", 0.0)
        trajectory = simulate_adamw(model, seed=seed)
        old = trajectory.bf16(0.0)
        cases = [*ADAMW_FRACTIONS, UNIFORM_CASE]
        rows: list[dict[str, object]] = []
        for index, case in enumerate(cases):
            ctx.progress(f"case {case}", index / len(cases))
            if case == UNIFORM_CASE:
                new = uniform_case(old, 0.01, seed=seed + 1)
            else:
                lr = calibrate_lr(trajectory, ADAMW_FRACTIONS[case])
                logger.info("case %s: lr %.3g", case, lr)
                new = trajectory.bf16(lr)
            rows += measure_case(case, old, new, threads=ctx.threads, repeats=repeats)
        ctx.progress("codec done", 1.0)
    return BenchReport(
        bench="codec", quick=ctx.quick, machine=machine_info(), results=rows, summary=_summary(rows)
    )


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: the quick (~65 MiB) or full (~517 MiB) model, a model of
    ``ctx.size_bytes``, or on a GPU the GPU delta encoder."""
    if ctx.device == "cuda":
        from refit_lab.bench.codec_gpu import measure_gpu

        return measure_gpu(ctx)
    if ctx.size_bytes is not None:
        return measure(ctx, model=ModelShape.of_bytes(ctx.size_bytes))
    return measure(ctx, model=QUICK_MODEL if ctx.quick else FULL_MODEL)
