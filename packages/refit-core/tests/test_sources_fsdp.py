"""DTensorSource over a real FSDP2 model sharded on 2 gloo ranks (spawned processes).

One spawned run of 2 ranks does every scenario and writes a JSON report per rank; the tests
below check the reports. The trainer model is the reference engine's own decoder in fp32
(fused ``qkv_proj`` / ``gate_up_proj``), the engine a bf16 ``ReferenceEngine`` that loads HF
checkpoint names, so the source splits the fused tensors on the way.

Memory bound (stated, measured, asserted): with U the largest unit and B = max(bucket size,
U), both in the engine's dtype, one gather's transient is at most 3U on 2 ranks (the cast
shard U/2, DTensor's padded shard U/2 and padded gather U for an uneven shard, and the
unpadded copy U), so a sending rank's RSS grows by at most B + 3U during the stream and a
non-sending rank's by at most 3U. The test allows 4 MiB more (allocator, gloo, caches), runs
the children with a fixed glibc mmap threshold so freed tensors leave the RSS, and checks
that the bound stays under half the model. Measured here (U = 4.0 MiB, B = U, bf16 model
56 MiB): about 12 MiB on the sender, 13 MiB on the other rank, against bounds of 20 and
16 MiB.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import runpy
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

WORKER_RUN_NAME = "__refit_sources_fsdp_worker__"
WORLD = 2
MiB = 1024 * 1024
SLACK_BYTES = 4 * MiB
RUN_TIMEOUT_S = 240.0
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


# ----------------------------------------------------------------------------- worker side


def _config(**overrides: Any) -> Any:
    from refit_lab.reference_engine import ReferenceModelConfig

    fields: dict[str, Any] = {
        "vocab_size": 67,  # odd: the embedding and lm_head shard unevenly
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 40,
        "dtype": "float32",
    }
    fields.update(overrides)
    return ReferenceModelConfig(**fields)


def _name_map(config: Any) -> Any:
    from refit_core.sources import GATE_UP_SPLIT, NameMap, qkv_split

    head = config.head_dim
    return NameMap(
        splits=(qkv_split(config.num_heads * head, config.num_kv_heads * head), GATE_UP_SPLIT)
    )


def _trainer(config: Any, seed: int) -> tuple[Any, dict[str, Any], Any]:
    """A seeded fp32 model FSDP2-sharded over the world, its unsharded twin's state, the mesh."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refit_lab.reference_engine import ReferenceModel

    model = ReferenceModel(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
            param.requires_grad_(True)
    twin = {name: t.detach().clone() for name, t in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, twin, mesh


def _digest(named: Any) -> str:
    from refit_core.sources import checkpoint_items
    from refit_lab.digest import combined_digest, state_digest

    return combined_digest(state_digest(checkpoint_items(named)))


@contextmanager
def _count_casts() -> Iterator[list[tuple[str, str]]]:
    """Record, as (from, to), every torch call made while active whose tensor result has
    another dtype than its first tensor argument (``to``, ``bfloat16()``, ``type()``...)."""
    import torch
    from torch.overrides import TorchFunctionMode

    casts: list[tuple[str, str]] = []

    class Casts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            first = args[0] if args else None
            tensors = isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor)
            if tensors and out.dtype != first.dtype:
                casts.append((str(first.dtype), str(out.dtype)))
            return out

    with Casts():
        yield casts


def _scenario_twin(rank: int) -> dict[str, Any]:
    """Both ranks send: the sharded stream equals the unsharded twin's, bit for bit."""
    from refit_core.sources import DTensorSource, StateDictSource

    config = _config()
    model, twin, mesh = _trainer(config, seed=1)
    name_map = _name_map(config)
    streams: dict[str, Any] = {}
    for dtype in ("bfloat16", None):
        expected = StateDictSource(twin, dtype=dtype, name_map=name_map)
        for bucket in (None, 4096, 1 << 30):
            source = DTensorSource(
                model, dtype=dtype, name_map=name_map, bucket_size_bytes=bucket, sender_ranks={0, 1}
            )
            buckets = list(source.iter_buckets())
            tensors = [t for b in buckets for t in b.tensors]
            streams[f"{dtype}/{bucket}"] = {
                "names_match": [t.name for t in tensors] == list(expected.state_dict_info()),
                "info_match": source.state_dict_info() == expected.state_dict_info(),
                "digest_match": _digest(tensors) == _digest(expected.iter_tensors()),
                "buckets": len(buckets),
                "dtypes": sorted({str(t.tensor.dtype) for t in tensors}),
            }
    source = DTensorSource(model, dtype="bfloat16", name_map=name_map, sender_ranks={0, 1})
    with _count_casts() as casts:
        streamed = list(source.iter_tensors())
    return {
        "streams": streams,
        "fuse": _fuse_with_scales(twin, name_map, mesh),
        "casts": casts,
        "trainer_tensors": len(twin),
        "streamed_tensors": len(streamed),
    }


def _fuse_with_scales(twin: dict[str, Any], split_map: Any, mesh: Any) -> dict[str, Any]:
    """Separate q/k/v and gate/up DTensors, fused by the source, with FP8-style scales riding
    on ``o_proj``, equal the twin's fused tensors and the same scales."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from refit_core.sources import (
        GATE_UP_FUSE,
        QKV_FUSE,
        SCALES_KEY,
        DTensorSource,
        NameMap,
        StateDictSource,
    )

    scales = {
        "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.rand(
            3, 2, generator=torch.Generator().manual_seed(4)
        ),
        "model.layers.0.self_attn.o_proj.input_scale": torch.tensor(0.25),
    }
    separate = {t.name: t.tensor for t in StateDictSource(twin, name_map=split_map).iter_tensors()}
    state = {
        name: distribute_tensor(tensor, mesh, [Shard(0)]) if tensor.dim() else tensor
        for name, tensor in {**separate, **scales}.items()
    }
    source = DTensorSource(
        state,
        dtype="bfloat16",
        name_map=NameMap(fuses=(QKV_FUSE, GATE_UP_FUSE)),
        bucket_size_bytes=4096,
        sender_ranks={0, 1},
    )
    tensors = list(source.iter_tensors())
    expected = StateDictSource({**twin, **scales}, dtype="bfloat16")
    riders = [t.metadata.get(SCALES_KEY, {}) for t in tensors]
    return {
        "info_match": source.state_dict_info() == expected.state_dict_info(),
        "digest_match": _digest(tensors) == _digest(expected.iter_tensors()),
        "scales": sorted(name for rider in riders for name in rider),
        "scale_dtypes": sorted({str(t.dtype) for rider in riders for t in rider.values()}),
    }


def _broadcast(tensor: Any) -> None:
    import torch.distributed as dist

    dist.broadcast(tensor, src=0, async_op=True).wait(COLLECTIVE_TIMEOUT)


def _scenario_refit(rank: int) -> dict[str, Any]:
    """Rank 0 sends each bucket to rank 1's engine by broadcast on the gathers' own group."""
    import torch
    import torch.distributed as dist

    from refit_core.sources import DTensorSource, StateDictSource, checkpoint_items
    from refit_lab.reference_engine import ReferenceEngine

    config = _config()
    model, twin, _ = _trainer(config, seed=2)
    name_map = _name_map(config)
    source = DTensorSource(
        model, dtype="bfloat16", name_map=name_map, bucket_size_bytes=6000, sender_ranks={0}
    )
    engine = ReferenceEngine(_config(dtype="bfloat16")) if rank == 1 else None
    sent: list[Any] = []
    kept_elsewhere = 0
    buckets = 0
    for bucket in source.iter_buckets():
        buckets += 1
        with source.order_guard.consumer_turn():
            if rank == 0:
                for _, tensor in checkpoint_items(bucket.tensors):
                    _broadcast(tensor)
                sent.extend(bucket.tensors)
            else:
                kept_elsewhere += len(bucket.tensors)
                received = [
                    (name, torch.empty(spec.shape, dtype=getattr(torch, spec.dtype)))
                    for name, spec in bucket.info.items()
                ]
                for _, tensor in received:
                    _broadcast(tensor)
                assert engine is not None
                engine.load_weights(received)
    digests: list[Any] = [None] * WORLD
    dist.all_gather_object(digests, engine.combined_digest() if engine else _digest(sent))
    expected = _digest(StateDictSource(twin, dtype="bfloat16", name_map=name_map).iter_tensors())
    return {
        "trainer_digest": digests[0],
        "engine_digest": digests[1],
        "twin_digest": expected,
        "buckets": buckets,
        "kept_on_non_sender": kept_elsewhere,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _scenario_memory(rank: int) -> dict[str, Any]:
    """Peak RSS growth while streaming a 56 MiB (bf16) model in 4 MiB buckets."""
    import gc

    from refit_core.sources import DTensorSource
    from refit_core.sources.plan import state_plan, state_tensors

    config = _config(
        vocab_size=4099,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
    )
    model, twin, _ = _trainer(config, seed=3)
    del twin
    name_map = _name_map(config)
    bucket_bytes = 4 * MiB
    source = DTensorSource(
        model, dtype="bfloat16", name_map=name_map, bucket_size_bytes=bucket_bytes
    )
    units = state_plan(state_tensors(model), name_map, "bfloat16")
    largest = max(unit.nbytes for unit in units)
    model_bytes = sum(unit.nbytes for unit in units)
    gc.collect()
    baseline = _rss_bytes()
    sampled = [baseline]  # written by the sampler thread only
    at_yields = [baseline]
    held_peak = 0
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            sampled[0] = max(sampled[0], _rss_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for bucket in source.iter_buckets():
            at_yields.append(_rss_bytes())
            held = sum(t.tensor.numel() * t.tensor.element_size() for t in bucket.tensors)
            held_peak = max(held_peak, held)
    finally:
        stop.set()
        sampler.join(timeout=10)
    return {
        "growth_bytes": max(sampled[0], *at_yields) - baseline,
        "held_peak_bytes": held_peak,
        "largest_unit_bytes": largest,
        "bucket_bytes": bucket_bytes,
        "model_bytes": model_bytes,
        "sends": rank == 0,
    }


def _worker(rank: int, store_path: str, report_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        report["memory"] = _scenario_memory(rank)
        report["twin"] = _scenario_twin(rank)
        report["refit"] = _scenario_refit(rank)
    except BaseException:
        report["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
        Path(report_dir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == WORKER_RUN_NAME:
    _worker(**globals()["WORKER_ARGS"])


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Spawn the 2 ranks once, wait for them (bounded), and return each rank's report."""
    tmp = tmp_path_factory.mktemp("fsdp")
    ctx = mp.get_context("spawn")
    env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "GLOO_SOCKET_IFNAME": "lo"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        procs = [
            ctx.Process(
                target=runpy.run_path,
                args=(__file__,),
                kwargs={
                    "run_name": WORKER_RUN_NAME,
                    "init_globals": {
                        "WORKER_ARGS": {
                            "rank": rank,
                            "store_path": str(tmp / "store"),
                            "report_dir": str(tmp),
                        }
                    },
                },
            )
            for rank in range(WORLD)
        ]
        for proc in procs:
            proc.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [proc.pid for proc in procs if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    assert not hung, f"ranks {hung} still running after {RUN_TIMEOUT_S} s"
    out = [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, report in enumerate(out):
        assert "error" not in report, f"rank {rank}:\n{report['error']}"
    return out


pytestmark = [
    pytest.mark.timeout(RUN_TIMEOUT_S + 60),
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for RSS"),
]


def test_sharded_stream_equals_unsharded_twin_bitwise(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        streams = report["twin"]["streams"]
        for key, outcome in streams.items():
            assert outcome["names_match"] and outcome["info_match"], key
            assert outcome["digest_match"], key
        assert streams["bfloat16/None"]["dtypes"] == ["torch.bfloat16"]
        assert streams["None/None"]["dtypes"] == ["torch.float32"]
        assert streams["bfloat16/None"]["buckets"] > streams["bfloat16/4096"]["buckets"] > 1
        assert streams["bfloat16/1073741824"]["buckets"] == 1


def test_fuse_and_scales_over_dtensors(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        fuse = report["twin"]["fuse"]
        assert fuse["info_match"] and fuse["digest_match"]
        assert fuse["scales"] == [
            "model.layers.0.self_attn.o_proj.input_scale",
            "model.layers.0.self_attn.o_proj.weight_scale_inv",
        ]
        assert fuse["scale_dtypes"] == ["torch.float32"]


def test_fp32_masters_are_cast_once(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        twin = report["twin"]
        assert len(twin["casts"]) == twin["trainer_tensors"]
        assert {tuple(c) for c in twin["casts"]} == {("torch.float32", "torch.bfloat16")}


def test_refit_between_ranks_on_the_gather_group_delivers_the_trainer_digest(
    reports: list[dict[str, Any]],
) -> None:
    refit = reports[0]["refit"]
    assert refit["trainer_digest"] == refit["engine_digest"] == refit["twin_digest"]
    assert refit["buckets"] > 1
    assert reports[1]["refit"]["kept_on_non_sender"] == 0


def test_peak_rss_stays_within_the_stated_bound(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        memory = report["memory"]
        unit = memory["largest_unit_bytes"]
        bucket = max(memory["bucket_bytes"], unit)
        bound = (bucket if memory["sends"] else 0) + 3 * unit
        assert bound + SLACK_BYTES < memory["model_bytes"] / 2
        assert memory["growth_bytes"] <= bound + SLACK_BYTES, memory
        if memory["sends"]:
            assert memory["held_peak_bytes"] <= bucket
            assert memory["growth_bytes"] >= memory["held_peak_bytes"] / 2, memory


def test_the_plain_source_casts_fp32_masters_once_into_the_engine_digest() -> None:
    import torch

    from refit_core.sources import StateDictSource
    from refit_lab.reference_engine import ReferenceEngine, random_checkpoint

    config = _config(dtype="bfloat16")
    generator = torch.Generator().manual_seed(8)
    masters = {  # fp32 masters a step away from any bf16 value
        name: t.float() + 1e-3 * torch.randn(t.shape, generator=generator)
        for name, t in random_checkpoint(config, seed=7).items()
    }
    with _count_casts() as casts:
        tensors = list(StateDictSource(masters, dtype="bfloat16").iter_tensors())
    assert len(casts) == len(masters)
    assert set(casts) == {("torch.float32", "torch.bfloat16")}
    engine = ReferenceEngine(config)
    engine.load_weights((t.name, t.tensor) for t in tensors)
    assert engine.combined_digest() == _digest(tensors)
