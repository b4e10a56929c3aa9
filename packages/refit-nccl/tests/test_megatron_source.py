"""MegatronSource over real gloo groups: bitwise HF twin, engine digest, refit, bad input.

One spawn of four processes runs every step (``megatron_source_workers``); the tests check the
reports. The oracle (the HF twin) is built from the natural tensors, not by a gather.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from megatron_model import CONFIG, MOE
from megatron_source_workers import run
from nccl_workers import Report
from refit_core.sources import ShardedWeightSource, WeightSource
from refit_lab.faults import ProcessGang
from refit_lab.ray_cluster import free_port
from refit_nccl.megatron import GPTConfig, hf_name, hf_name_map
from refit_nccl.megatron.hf import to_checkpoint_layout

PROCESSES = 4
TIMEOUT_S = 2.0
RELEASE_SLACK_S = 3.0
STEPS: dict[str, Report] = {
    "tp2": {"par": {"tp": 2}},
    "pp2": {"par": {"pp": 2}},
    "tp2 pp2 fp32 masters, sender 3": {"par": {"tp": 2, "pp": 2}, "fp32": True, "sender": 3},
    "tp2 dp2": {"par": {"tp": 2, "dp": 2}},
    "moe tp2": {"par": {"tp": 2}, "moe": True},
    "refit beside the gathers": {"refit": True},
    "missing shard": {"par": {"tp": 2}, "drop": 1, "timeout_s": TIMEOUT_S},
    "mismatched shape": {"par": {"tp": 2, "pp": 2}, "narrow": 1, "timeout_s": TIMEOUT_S},
    "absent peer": {"par": {"tp": 2}, "absent": 1, "timeout_s": TIMEOUT_S},
}
FAULTS = ("drop", "narrow", "absent")
STREAMS = [n for n, step in STEPS.items() if "par" in step and not set(FAULTS) & set(step)]
Reports = dict[str, dict[int, Report]]


@pytest.fixture(scope="module")
def reports() -> Reports:
    named = [
        {"name": name, "port": free_port(), "refit_port": free_port(), **step}
        for name, step in STEPS.items()
    ]
    expected = sum(3 if "refit" in step else _world(step) for step in named)
    with ProcessGang() as gang:
        for proc in range(PROCESSES):
            gang.spawn(run, gang.results, proc, named)
        collected = gang.collect(expected, timeout_s=150)
    by_step: Reports = defaultdict(dict)
    for report in collected:
        by_step[report["step"]][report["proc"]] = report
    return by_step


def _world(step: Report) -> int:
    par = step["par"]
    return int(par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1))


@pytest.mark.parametrize("step", STREAMS)
def test_stream_is_bitwise_the_unsharded_twins_checkpoint(reports: Reports, step: str) -> None:
    sender = STEPS[step].get("sender", 0)
    got = reports[step]
    assert sorted(got) == list(range(_world(STEPS[step])))
    for proc, report in got.items():
        assert report["error"] is None, (proc, report)
        if proc != sender:
            assert report["kept"] == 0, (proc, report)
    ours = got[sender]
    assert ours["wrong"] == [], ours["wrong"][:5]
    assert ours["digests_equal"]
    assert ours["buckets 1024"] > ours["buckets 1073741824"] == 1
    assert ours["buckets None"] >= ours["buckets 1024"]


def test_a_concurrent_collective_refit_on_the_trainer_ranks_does_not_deadlock(
    reports: Reports,
) -> None:
    got = reports["refit beside the gathers"]
    assert all(report["error"] is None for report in got.values()), got
    assert got[2]["digest_equal"]
    assert got[0]["buckets"] == got[2]["buckets"] > 1
    assert got[1]["kept"] == 0


@pytest.mark.parametrize(
    ("step", "culprit"), [("missing shard", "missing"), ("mismatched shape", "expected")]
)
def test_bad_shards_give_every_rank_a_typed_error_at_once(
    reports: Reports, step: str, culprit: str
) -> None:
    bad = STEPS[step].get("drop", STEPS[step].get("narrow"))
    got = reports[step]
    assert sorted(got) == list(range(_world(STEPS[step])))
    for proc, report in got.items():
        assert report["error"] == "GeometryMismatchError", (proc, report)
        assert report["elapsed_s"] < TIMEOUT_S, (proc, report)
        assert culprit in report["message"] if proc == bad else f"[{bad}]" in report["message"]


def test_a_rank_that_never_gathers_ends_its_peers_by_the_deadline(reports: Reports) -> None:
    got = reports["absent peer"]
    assert got[1]["absent"]
    assert got[0]["error"] == "RefitTimeoutError", got[0]
    assert got[0]["elapsed_s"] < TIMEOUT_S + RELEASE_SLACK_S


# ----------------------------------------------------------------------------- one process


def test_hf_names_cover_every_megatron_parameter_and_refuse_others() -> None:
    from refit_nccl.megatron import Parallelism, gpt_layouts

    for config in (CONFIG, MOE):
        names = [hf_name(name) for name in gpt_layouts(config, Parallelism())]
        assert len(set(names)) == len(names)
    assert hf_name("decoder.layers.3.mlp.experts.7.linear_fc2.weight") == (
        "model.layers.3.mlp.experts.7.down_proj.weight"
    )
    for bad in ("decoder.layers.0.mlp.experts.1.linear_fc3.weight", "embedding.weight"):
        with pytest.raises(ValueError, match="no Megatron-Core GPT parameter"):
            hf_name(bad)


def test_qkv_is_un_interleaved_per_query_group() -> None:
    config = GPTConfig(layers=1, hidden=4, heads=4, query_groups=2, ffn=4, vocab=4)
    # rows per group: q0 q1 k v (head_dim 1); value = 10 * group + slot
    fused = torch.tensor([[10.0 * g + s] for g in range(2) for s in range(4)])
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    hf = to_checkpoint_layout(name, fused, config)
    assert hf.flatten().tolist() == [0, 1, 10, 11, 2, 12, 3, 13]
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert to_checkpoint_layout(proj, fused, config) is fused
    split = hf_name_map(config).split_of(hf_name(name))
    assert split is not None and split[0].part_rows(name, 8) == (4, 2, 2)


def test_the_source_is_a_sharded_weight_source_and_refuses_bad_arguments() -> None:
    from refit_nccl.group.abortable import AbortableProcessGroup
    from refit_nccl.group.spec import GroupSpec
    from refit_nccl.megatron import MegatronSource, Parallelism

    group = AbortableProcessGroup(GroupSpec("127.0.0.1", 1, 0, 1))
    source = MegatronSource(CONFIG, Parallelism(), dict, group, dtype="float32")
    assert isinstance(source, WeightSource) and isinstance(source, ShardedWeightSource)
    assert source.sends
    info = source.state_dict_info()
    assert info["model.layers.1.self_attn.k_proj.weight"].shape == (8, 16)
    assert {spec.dtype for spec in info.values()} == {"float32"}
    for bad, match in (
        ({"sender_rank": 1}, "sender_rank"),
        ({"params_dtype": "int8"}, "params_dtype"),
        ({"bucket_size_bytes": 0}, "bucket_size_bytes"),
    ):
        with pytest.raises(ValueError, match=match):
            MegatronSource(CONFIG, Parallelism(), dict, group, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs 2"):
        MegatronSource(CONFIG, Parallelism(tp=2), dict, group)


def test_a_non_sending_trainer_rank_of_a_sharded_source_is_refused_before_joining() -> None:
    from refit_core import GeometryMismatchError
    from refit_core.backend import CollectiveSenderSpec
    from refit_nccl.group.abortable import AbortableProcessGroup
    from refit_nccl.group.spec import GroupSpec
    from refit_nccl.megatron import MegatronSource, Parallelism
    from refit_nccl.roles.contract import JoinRequest
    from refit_nccl.roles.trainer import TrainerEndpoint

    group = AbortableProcessGroup(GroupSpec("127.0.0.1", 1, 0, 1))
    source = MegatronSource(CONFIG, Parallelism(), dict, group)

    class Policy:
        def weight_source(self) -> MegatronSource:
            return source

    trainer = TrainerEndpoint(Policy())
    geometry = CollectiveSenderSpec("refit", 1 << 20, 2)
    spec = GroupSpec("127.0.0.1", free_port(), 1, 2, name="refused")
    with pytest.raises(GeometryMismatchError, match="only its sending rank joins"):
        trainer.refit_join(JoinRequest(spec, trainer.refit_state(), geometry, 5.0))
