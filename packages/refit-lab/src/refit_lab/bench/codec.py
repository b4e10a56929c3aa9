"""Bench `codec`: the sparse delta codec against memcpy and the peers' delta recipes.

The state is transformer-shaped bf16 (embedding, qkv, o, gate_up, down, norms): about 65 MiB
quick, 517 MiB full. Deltas come from simulated optimizer steps: fp32 master weights take one
AdamW step (moments from a few steps of random gradients), then are cast to bf16, with the
learning rate calibrated so that about 0.1%, 1%, 5% and 30% of the bf16 elements change. A
last case changes 1% of the elements at uniformly random positions to random bits.

Every case times, in interleaved rounds on the same tensors and with the same torch threads:
the codec (tracker encode with the checksum inside, apply with undo recording), the
slime/SkyRL recipe (XOR + zstd-1 + xxh3-128), the NeMo-RL recipe (gaps + torch.save + zstd-1 +
BLAKE2b-128), the straightforward numpy delta the issue calibrates its targets with, and memcpy
of the dense bytes. Rates are dense input bytes per second.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from refit_core import TensorSpec, WeightVersion
from refit_lab.bench.harness import BenchContext, BenchReport, machine_info, timeit
from refit_lab.bench.references import (
    memcpy_gbps,
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

logger = logging.getLogger(__name__)

State = dict[str, torch.Tensor]

ADAMW_FRACTIONS: dict[str, float] = {
    "adamw_0.1pct": 0.001,
    "adamw_1pct": 0.01,
    "adamw_5pct": 0.05,
    "adamw_30pct": 0.30,
}
UNIFORM_CASE = "uniform_1pct"
SUMMARY_CASE = "adamw_1pct"
METHODS = ("refit", "xor_zstd", "nemo", "numpy_naive")
REPEATS = 5
_BETAS = (0.9, 0.999)
_EPS = 1e-8
_WEIGHT_DECAY = 0.01
_MOMENT_STEPS = 3
_CALIBRATION_SAMPLES = 1 << 21
_BISECTION_STEPS = 40


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the synthetic transformer."""

    hidden: int
    intermediate: int
    vocab: int
    layers: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape, in the order an engine loads them."""
        h, inter = self.hidden, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            prefix = f"layers.{i}"
            shapes[f"{prefix}.input_layernorm.weight"] = (h,)
            shapes[f"{prefix}.self_attn.qkv_proj.weight"] = (3 * h, h)
            shapes[f"{prefix}.self_attn.o_proj.weight"] = (h, h)
            shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
            shapes[f"{prefix}.mlp.gate_up_proj.weight"] = (2 * inter, h)
            shapes[f"{prefix}.mlp.down_proj.weight"] = (h, inter)
        shapes["norm.weight"] = (h,)
        return shapes


QUICK_MODEL = ModelShape(hidden=1024, intermediate=2816, vocab=8192, layers=2)
FULL_MODEL = ModelShape(hidden=2048, intermediate=5632, vocab=32000, layers=4)


@dataclass(frozen=True)
class Trajectory:
    """fp32 master weights and one AdamW step direction: ``w - lr * step`` is the update."""

    master: State
    step: State

    def bf16(self, lr: float) -> State:
        """The bf16 weights after a step of learning rate ``lr`` (0: the current weights)."""
        return {
            name: (w - lr * self.step[name]).to(torch.bfloat16) if lr else w.to(torch.bfloat16)
            for name, w in self.master.items()
        }


def simulate_adamw(model: ModelShape, *, seed: int) -> Trajectory:
    """Master weights (normal 0.02, norms at 1) and an AdamW step from random-gradient moments."""
    gen = torch.Generator().manual_seed(seed)
    b1, b2 = _BETAS
    master: State = {}
    step: State = {}
    for name, shape in model.shapes().items():
        if len(shape) == 1:
            w = 1.0 + 0.01 * torch.randn(shape, generator=gen)
        else:
            w = 0.02 * torch.randn(shape, generator=gen)
        m = torch.zeros(shape)
        v = torch.zeros(shape)
        for _ in range(_MOMENT_STEPS):
            g = 1e-3 * torch.randn(shape, generator=gen)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat = m / (1 - b1**_MOMENT_STEPS)
        v_hat = v / (1 - b2**_MOMENT_STEPS)
        step[name] = m_hat.div_(v_hat.sqrt_().add_(_EPS)).add_(w, alpha=_WEIGHT_DECAY)
        master[name] = w
    return Trajectory(master, step)


def _changed_fraction(w: torch.Tensor, step: torch.Tensor, lr: float) -> float:
    before = w.to(torch.bfloat16).view(torch.int16)
    after = (w - lr * step).to(torch.bfloat16).view(torch.int16)
    return float((before != after).double().mean())


def calibrate_lr(trajectory: Trajectory, fraction: float) -> float:
    """The learning rate at which about ``fraction`` of the bf16 elements change (bisection)."""
    total = sum(w.numel() for w in trajectory.master.values())
    stride = max(1, total // _CALIBRATION_SAMPLES)
    w = torch.cat([t.reshape(-1)[::stride] for t in trajectory.master.values()])
    step = torch.cat([t.reshape(-1)[::stride] for t in trajectory.step.values()])
    lo, hi = -14.0, 0.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if _changed_fraction(w, step, 10.0**mid) < fraction:
            lo = mid
        else:
            hi = mid
    return float(10.0 ** ((lo + hi) / 2))


def uniform_case(old: State, fraction: float, *, seed: int) -> State:
    """``old`` with ``fraction`` of the elements, at uniform positions, set to other random bits."""
    gen = torch.Generator().manual_seed(seed)
    new: State = {}
    for name, tensor in old.items():
        bits = tensor.clone().view(torch.int16).view(-1)
        hit = torch.rand(bits.numel(), generator=gen) < fraction
        flips = torch.randint(1, 1 << 16, (int(hit.sum()),), generator=gen, dtype=torch.int32)
        bits[hit] ^= flips.to(torch.int16)
        new[name] = bits.view(torch.bfloat16).view(tensor.shape)
    return new


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two states hold exactly the same bits."""
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


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
    """Timed rounds of one method."""

    encode_s: list[float]
    apply_s: list[float]
    wire_bytes: int = 0
    bitexact: bool = True

    def run(self, method: _Method, new: State, receiver: State, *, record: bool) -> None:
        wire: list[int] = []
        encode = timeit(lambda: wire.append(method.encode()), repeats=1, warmup=0)
        apply = timeit(method.apply, repeats=1, warmup=0)
        self.wire_bytes = wire[-1]
        self.bitexact = self.bitexact and same_bits(receiver, new)
        method.reset()
        if record:
            self.encode_s.append(encode.min_s)
            self.apply_s.append(apply.min_s)


def measure_case(
    case: str, old: State, new: State, *, threads: int, repeats: int
) -> list[dict[str, object]]:
    """Result rows of one case: every method and memcpy, timed in interleaved rounds."""
    dense = sum(t.numel() * t.element_size() for t in old.values())
    changed = sum(int((_bits(old[k]) != _bits(new[k])).sum()) for k in old)
    scratch = torch.empty(
        max(t.numel() * t.element_size() for t in old.values()), dtype=torch.uint8
    )
    receivers = {m: {k: v.clone() for k, v in old.items()} for m in METHODS}
    specs = {name: TensorSpec.of(tensor) for name, tensor in old.items()}
    samples = {m: _Samples([], []) for m in METHODS}
    memcpy: list[float] = []
    with DeltaCompressionTracker(specs, TrackerConfig(threads=threads)) as tracker:
        tracker.load_baseline(old, WeightVersion(0))
        methods = {
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
        for round_index in range(repeats + 1):
            for name, method in methods.items():
                samples[name].run(method, new, receivers[name], record=round_index > 0)
            if round_index:
                memcpy.append(memcpy_gbps(dense, repeats=1, threads=threads))
    memcpy_rate = statistics.median(memcpy)
    rows: list[dict[str, object]] = []
    for name, got in samples.items():
        encode_gbps = dense / statistics.median(got.encode_s) / 1e9
        apply_gbps = dense / statistics.median(got.apply_s) / 1e9
        rows.append(
            {
                "case": case,
                "method": name,
                "changed_fraction": changed / (dense // 2),
                "encode_gbps": encode_gbps,
                "apply_gbps": apply_gbps,
                "wire_bytes": got.wire_bytes,
                "wire_vs_dense": got.wire_bytes / dense,
                "encode_vs_memcpy": encode_gbps / memcpy_rate,
                "apply_vs_memcpy": apply_gbps / memcpy_rate,
                "bitexact": got.bitexact,
            }
        )
    rows.append({"case": case, "method": "memcpy", "encode_gbps": memcpy_rate, "wire_bytes": dense})
    logger.info("codec bench %s: %s", case, rows[0])
    return rows


def _summary(rows: list[dict[str, object]]) -> dict[str, float | bool]:
    at = {r["method"]: r for r in rows if r["case"] == SUMMARY_CASE}
    ours, xor, nemo, naive = at["refit"], at["xor_zstd"], at["nemo"], at["numpy_naive"]

    def num(row: dict[str, object], key: str) -> float:
        value = row[key]
        if not isinstance(value, int | float):
            raise TypeError(f"{key} is not a number: {value!r}")
        return float(value)

    return {
        "encode_speedup_vs_xor_zstd": num(ours, "encode_gbps") / num(xor, "encode_gbps"),
        "wire_ratio_vs_xor_zstd": num(ours, "wire_bytes") / num(xor, "wire_bytes"),
        "encode_speedup_vs_nemo_recipe": num(ours, "encode_gbps") / num(nemo, "encode_gbps"),
        "encode_fraction_of_memcpy": num(ours, "encode_vs_memcpy"),
        "apply_fraction_of_memcpy": num(ours, "apply_vs_memcpy"),
        "roundtrip_bitexact": all(r["bitexact"] for r in rows if "bitexact" in r),
        "encode_speedup_vs_numpy_naive": num(ours, "encode_gbps") / num(naive, "encode_gbps"),
        "changed_fraction": num(ours, "changed_fraction"),
    }


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
    """The registered entry point: the quick (~65 MiB) or full (~517 MiB) model."""
    return measure(ctx, model=QUICK_MODEL if ctx.quick else FULL_MODEL)
