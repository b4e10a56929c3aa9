"""MegatronWeightSynchronizer in one process: factory rows, in-place reshard, import hygiene."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from megatron_model import CONFIG, Side, megatron_shard, natural_state
from refit_core import create_weight_synchronizer
from refit_core.backend import SynchronizerRequest
from refit_nccl.megatron import (
    MegatronWeightSynchronizer,
    Parallelism,
    build_collective_reshard,
    build_colocated_reshard,
    gpt_layouts,
    plan_reshard,
)


def sides(src: Parallelism, dst: Parallelism, rank: int | None = 0) -> tuple[Side, Side]:
    state = natural_state(CONFIG, 1)
    policy = Side(gpt_layouts(CONFIG, src), rank, megatron_shard(state, CONFIG, src, 0))
    target = megatron_shard(state, CONFIG, dst, 0)
    generation = Side(
        gpt_layouts(CONFIG, dst), rank, {n: torch.zeros_like(t) for n, t in target.items()}
    )
    return policy, generation


def test_entry_points_name_the_megatron_builders() -> None:
    rows = {ep.name: ep.load() for ep in entry_points(group="refit.backends")}
    colocated = rows["megatron.colocated.reshard"]
    collective = rows["megatron.non-colocated.collective"]

    def builder(reference: str) -> object:
        module, _, name = reference.partition(":")
        return getattr(importlib.import_module(module), name)

    assert builder(colocated.builder) is build_colocated_reshard
    assert builder(collective.builder) is build_collective_reshard
    assert colocated.default and collective.default
    assert (colocated.train_cluster, collective.train_cluster) == (
        (),
        ("get_master_address_and_port",),
    )


def test_colocated_matching_layouts_alias_and_need_no_group() -> None:
    policy, generation = sides(Parallelism(), Parallelism())
    generation.shards = policy.shards
    with create_weight_synchronizer(policy, generation, "megatron", colocated=True) as sync:
        assert isinstance(sync, MegatronWeightSynchronizer) and not sync.needs_group
        result = sync.sync_weights()
    assert (result.version, result.wire_bytes) == (1, 0)
    assert result.dense_bytes == sum(t.numel() * 2 for t in policy.shards.values())


def test_colocated_reshard_in_one_process_copies_into_the_inference_shards() -> None:
    policy, generation = sides(Parallelism(), Parallelism())
    with create_weight_synchronizer(
        policy, generation, "megatron", colocated=True, refit_timeout_s=30.0
    ) as sync:
        sync.sync_weights()
        assert not sync.is_stale()
    for name, tensor in policy.shards.items():
        assert torch.equal(generation.shards[name], tensor), name
        assert generation.shards[name].data_ptr() != tensor.data_ptr()


def request(policy: object, generation: object, colocated: bool) -> SynchronizerRequest:
    transport = "reshard" if colocated else "collective"
    return SynchronizerRequest(policy, generation, "megatron", colocated, transport)


def test_builders_refuse_what_they_cannot_plan() -> None:
    policy, generation = sides(Parallelism(), Parallelism())
    with pytest.raises(ValueError, match="megatron_layouts"):
        build_colocated_reshard(request(object(), generation, True))
    with pytest.raises(ValueError, match="do not name one process"):
        build_collective_reshard(request(policy, generation, False))
    crossing, generation = sides(Parallelism(tp=2), Parallelism(), rank=0)
    with pytest.raises(ValueError, match="rendezvous"):
        build_colocated_reshard(request(crossing, generation, True))


def test_synchronizer_refuses_dropping_shards() -> None:
    plan = plan_reshard(gpt_layouts(CONFIG, Parallelism()), gpt_layouts(CONFIG, Parallelism()))
    sync = MegatronWeightSynchronizer(plan, 0, dict, dict, lambda: ("127.0.0.1", 1))
    with pytest.raises(NotImplementedError, match="fixed layouts"):
        sync.reconcile_communicator({1})
    with pytest.raises(ValueError, match="not in a plan"):
        MegatronWeightSynchronizer(plan, 2, dict, dict, None)


@pytest.mark.timeout(60)
def test_import_refit_nccl_imports_neither_megatron_core_nor_the_reshard() -> None:
    code = (
        "import sys, refit_nccl; "
        "bad = [m for m in sys.modules if m.startswith(('megatron', 'refit_nccl.megatron'))]; "
        "assert not bad, bad; "
        "import refit_nccl.megatron; "
        "assert 'megatron' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
