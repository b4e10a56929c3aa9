"""The `codec` bench on a tiny model, its delta simulation, and the peers' recipes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from refit_lab.bench import codec, codec_gpu
from refit_lab.bench.deltas import ModelShape
from refit_lab.bench.harness import BENCHES, BenchContext, load_bench
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios
from refit_lab.bench.read_both import BLOCK_BYTES, ReadBoth
from refit_lab.bench.references import (
    nemo_apply,
    nemo_encode,
    numpy_delta_apply,
    numpy_delta_encode,
    xor_zstd_apply,
    xor_zstd_encode,
)

TINY = codec.ModelShape(hidden=64, intermediate=176, vocab=512, layers=1)
SUMMARY_KEYS = {
    "encode_speedup_vs_xor_zstd",
    "wire_ratio_vs_xor_zstd",
    "encode_speedup_vs_nemo_recipe",
    "encode_fraction_of_memcpy",
    "apply_fraction_of_memcpy",
    "roundtrip_bitexact",
}


def _at(method: str) -> dict[str, object]:
    return {"case": codec.SUMMARY_CASE, "method": method}


def _refit_encode_against(method: str) -> Ratio:
    return Ratio(Side("encode_gbps", _at("refit")), Side("encode_gbps", _at(method)))


SUMMARY_RATIOS = {
    "encode_speedup_vs_xor_zstd": _refit_encode_against("xor_zstd"),
    "encode_speedup_vs_nemo_recipe": _refit_encode_against("nemo"),
    "encode_speedup_vs_numpy_naive": _refit_encode_against("numpy_naive"),
    "encode_fraction_of_memcpy": Ratio(
        Side("encode_gbps", _at("refit")), Side("memcpy_gbps", _at("refit"))
    ),
    "apply_fraction_of_memcpy": Ratio(
        Side("apply_gbps", _at("refit")), Side("memcpy_gbps", _at("refit"))
    ),
    "ceiling_fraction_of_memcpy": Ratio(
        Side("encode_gbps", _at(codec.CEILING)), Side("memcpy_gbps", _at(codec.CEILING))
    ),
    "encode_fraction_of_ceiling": Ratio(
        Side("encode_gbps", _at("refit")), Side("encode_gbps", _at(codec.CEILING))
    ),
    "wire_ratio_vs_xor_zstd": Ratio(
        Side("wire_bytes", _at("refit")), Side("wire_bytes", _at("xor_zstd"))
    ),
}
"""Each summary ratio: the rows it compares, subject first."""


def _gpu(case: str, against: str) -> Ratio:
    return Ratio(Side("gbps", {"case": case}), Side("gbps", {"case": against}))


GPU_RATIOS = {
    "gpu_encode_fraction_of_d2d_copy": _gpu("refit_gpu", "d2d_copy"),
    "gpu_encode_speedup_vs_torch_ne_nonzero": _gpu("refit_gpu", "torch_ne_nonzero"),
    "gpu_diff_fraction_of_d2d_copy": _gpu("refit_gpu_diff", "d2d_copy"),
    "gpu_diff_speedup_vs_torch_ne_nonzero": _gpu("refit_gpu_diff", "torch_ne_nonzero"),
    "gpu_encode_speedup_vs_host_path": _gpu("refit_gpu", "refit_host"),
    "pinned_encode_fraction_of_d2d_copy": _gpu("refit_gpu_pinned", "d2d_copy"),
    "gpu_apply_fraction_of_d2d_copy": _gpu("refit_gpu_apply", "d2d_copy"),
}


def test_codec_is_registered() -> None:
    assert BENCHES["codec"] == "refit_lab.bench.codec:run"
    assert load_bench("codec") is codec.run


def test_quick_and_full_models_have_the_promised_sizes() -> None:
    def mib(model: codec.ModelShape) -> float:
        return sum(2 * torch.Size(s).numel() for s in model.shapes().values()) / 2**20

    assert 60 <= mib(codec.QUICK_MODEL) <= 70
    assert mib(codec.FULL_MODEL) >= 512
    names = set(codec.QUICK_MODEL.shapes())
    assert {"embed_tokens.weight", "norm.weight", "layers.1.mlp.down_proj.weight"} <= names


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3])
def test_calibrated_learning_rate_changes_about_the_requested_fraction(fraction: float) -> None:
    trajectory = codec.simulate_adamw(TINY, seed=1)
    lr = codec.calibrate_lr(trajectory, fraction)
    old, new = trajectory.bf16(0.0), trajectory.bf16(lr)
    changed = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in old)
    total = sum(t.numel() for t in old.values())
    assert changed / total == pytest.approx(fraction, rel=0.25)


def test_uniform_case_changes_the_requested_fraction_to_other_bits() -> None:
    old = codec.simulate_adamw(TINY, seed=2).bf16(0.0)
    new = codec.uniform_case(old, 0.05, seed=3)
    changed = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in old)
    total = sum(t.numel() for t in old.values())
    assert changed / total == pytest.approx(0.05, rel=0.1)


@pytest.mark.parametrize(
    ("encode", "apply"),
    [
        (xor_zstd_encode, xor_zstd_apply),
        (nemo_encode, nemo_apply),
        (numpy_delta_encode, numpy_delta_apply),
    ],
)
def test_recipes_roundtrip_and_check_their_digest(
    encode: Callable[[torch.Tensor, torch.Tensor], tuple[bytes, bytes]],
    apply: Callable[[bytes, bytes, torch.Tensor], None],
) -> None:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(1000, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[::9] = float("nan")
    payload, digest = encode(old, new)
    target = old.clone()
    apply(payload, digest, target)
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))
    with pytest.raises(ValueError, match="checksum"):
        apply(payload[:-1] + bytes([payload[-1] ^ 1]), digest, old.clone())


def test_tiny_run_reports_every_case_and_the_summary() -> None:
    report = codec.measure(BenchContext(quick=True, threads=2), model=TINY, repeats=2)
    cases = {row["case"] for row in report.results}
    assert cases == {*codec.ADAMW_FRACTIONS, codec.UNIFORM_CASE}
    methods = {row["method"] for row in report.results}
    assert methods == {*codec.METHODS, codec.CEILING, "memcpy"}
    assert report.summary.keys() >= SUMMARY_KEYS
    assert report.summary["roundtrip_bitexact"] is True
    assert all(row["bitexact"] for row in report.results if "bitexact" in row)
    assert all(row["differs"] for row in report.results if row["method"] == codec.CEILING)
    for row in report.results:
        if row["method"] in codec.METHODS:
            assert isinstance(row["wire_bytes"], int) and row["wire_bytes"] > 0
            assert isinstance(row["memcpy_gbps"], float) and row["memcpy_gbps"] > 0
    check_summary_ratios(
        report, SUMMARY_RATIOS, other_keys={"refit_encode_gbps", "changed_fraction"}
    )
    report.to_json()


@pytest.mark.parametrize(("name", "index"), [("big", 0), ("big", -1), ("small", 3)])
def test_the_ceiling_reads_every_byte_of_both_states(name: str, index: int) -> None:
    old = {"big": torch.zeros(3 * BLOCK_BYTES + 5, dtype=torch.uint8), "small": torch.zeros(7)}
    same = {k: v.clone() for k, v in old.items()}
    new = {k: v.clone() for k, v in old.items()}
    new[name].view(torch.uint8)[index] = 1
    for threads in (1, 2, 3):
        with ReadBoth(old, new, threads=threads) as changed, ReadBoth(old, same, threads=2) as not_:
            changed.seconds()
            not_.seconds()
            assert changed.differ and not not_.differ


@pytest.mark.parametrize("nbytes", [1 << 20, 65 << 20, 8 << 30])
def test_a_model_of_a_size_holds_at_least_that_many_bytes(nbytes: int) -> None:
    model = ModelShape.of_bytes(nbytes)
    assert nbytes <= model.nbytes <= nbytes + ModelShape.of_bytes(1).nbytes + nbytes // 4


def test_gpu_bench_logic_on_cpu_tensors() -> None:
    """The GPU bench's cases, checks and summary, run on CPU tensors (the device code path)."""
    ctx = BenchContext(quick=True, threads=2, size_bytes=1 << 20)
    report = codec_gpu.measure_gpu(ctx, repeats=1, device="cpu")
    cases = {row["case"] for row in report.results}
    assert cases == {
        "d2d_copy",
        *codec_gpu.ENCODERS,
        "refit_gpu_apply",
        "refit_gpu_diff",
        "torch_ne_nonzero",
    }
    assert report.summary["bitexact"] is True
    assert report.summary["state_bytes"] >= 1 << 20
    assert 0 < report.summary["to_host_fraction"] < 0.1
    assert report.summary.keys() >= GPU_RATIOS.keys()
    check_summary_ratios(
        report,
        GPU_RATIOS,
        other_keys={
            "gpu_encode_gbps",
            "gpu_apply_gbps",
            "to_host_fraction",
            "changed_fraction",
            "state_bytes",
        },
    )
    report.to_json()
