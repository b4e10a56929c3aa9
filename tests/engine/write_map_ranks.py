"""Rank processes of the write-map test: vLLM's own model classes, loaded by vLLM's own loader
on CPU without ``process_weights_after_loading`` (so no CPU repacking: the runtime parameters
are plain tensors, as unquantized weights are on a GPU), in a tensor-parallel group of vLLM's
own parallel state (gloo).

Each rank builds the model on checkpoint A, places every checkpoint tensor
(:func:`refit_zmq.vllm.targets.plan_targets`: write map captured and verified), then takes real
delta payloads from refit's producer (``DeltaCompressionTracker``) through the staged receiver
and writes them in place: a dense resync to A1, a sparse A1 -> A2 that is rolled back, the same
refit committed, and A2 -> A1 written and undone. After each step every runtime parameter is
compared bit for bit with a model vLLM loaded fresh from the checkpoint the step should leave.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def _build(path: str, tp: int) -> tuple[Any, Any, Any]:
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = _build_config(path, tp)
    loader = get_model_loader(config.load_config)
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        model = initialize_model(vllm_config=config)
    loader.load_weights(model, config.model_config)
    return config, loader, model


def _bits(model: Any) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().view(torch.int16).clone()
        for name, p in model.named_parameters()
        if p.dtype == torch.bfloat16
    }


def _differs(model: Any, expected: Mapping[str, torch.Tensor]) -> list[str]:
    now = _bits(model)
    return sorted(n for n, bits in expected.items() if not torch.equal(now[n], bits))


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _send(deltas: Any, payloads: Iterator[Any], transfer_id: str) -> int:
    count = 0
    for payload in payloads:
        body = b"".join(bytes(memoryview(frame).cast("B")) for frame in payload.frames)
        deltas.apply(memoryview(body), {"transfer_id": transfer_id})
        count += 1
    return count


def _case(paths: Mapping[str, str], tp: int) -> dict[str, Any]:
    from refit_core import TensorSpec, WeightVersion
    from refit_core.backend import checkpoint_specs
    from refit_core.vllm.write_map import capture_write_map
    from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig
    from refit_zmq.vllm.delta_receiver import StagedDeltas
    from refit_zmq.vllm.targets import CheckpointTargets, plan_targets

    config, loader, model = _build(paths["A"], tp)
    fresh = {state: _bits(_build(paths[state], tp)[2]) for state in ("A1", "A2")}
    specs = {
        n: (shape, getattr(torch, dtype))
        for n, (shape, dtype) in checkpoint_specs(paths["A"], "bfloat16").items()
    }
    found = capture_write_map(model, specs)
    plan = plan_targets(
        model, found, specs, lambda: loader.get_all_weights(config.model_config, model)
    )
    report: dict[str, Any] = {
        "changed_params": sum(not torch.equal(fresh["A1"][n], b) for n, b in fresh["A2"].items()),
        "shadowed": sorted(plan.shadowed),
        "reasons": dict(plan.reasons),
        "pieces": sum(len(p) for p in plan.pieces.values()),
    }
    targets = CheckpointTargets(model, plan, {})
    deltas = StagedDeltas(targets, specs, version=0)
    states = {s: _checkpoint(paths[s]) for s in ("A1", "A2")}
    tracker = DeltaCompressionTracker(
        {n: TensorSpec.of(t) for n, t in states["A1"].items()},
        TrackerConfig(bucket_size_bytes=64 << 10, max_item_bytes=24 << 10),
    )

    report["resync_payloads"] = _send(deltas, tracker.encode(states["A1"], WeightVersion(1)), "t1")
    deltas.commit("t1")
    tracker.commit()
    version, writes = deltas.take_committed()
    targets.apply(writes).discard()
    report["after_resync"] = (version, _differs(model, fresh["A1"]))

    _send(deltas, tracker.encode(states["A2"], WeightVersion(2)), "t2")
    deltas.rollback("t2")
    tracker.abort()
    report["after_rollback"] = (deltas.take_committed()[1], _differs(model, fresh["A1"]))

    report["delta_payloads"] = _send(deltas, tracker.encode(states["A2"], WeightVersion(2)), "t3")
    deltas.commit("t3")
    tracker.commit()
    version, writes = deltas.take_committed()
    report["delta_writes"] = len(writes)
    report["delta_elements"] = sum(w.values.numel() for w in writes)
    targets.apply(writes).discard()
    report["after_delta"] = (version, _differs(model, fresh["A2"]))

    _send(deltas, tracker.encode(states["A1"], WeightVersion(3)), "t4")
    deltas.commit("t4")
    undo = targets.apply(deltas.take_committed()[1])
    report["written"] = _differs(model, fresh["A1"])
    undo.restore()
    report["after_undo"] = _differs(model, fresh["A2"])
    return report


def run_rank(
    rank: int, world: int, port: int, cases: Mapping[str, Mapping[str, str]], results: Any
) -> None:
    """One rank: vLLM's parallel state, then every case (architecture -> checkpoints)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    try:
        first = next(iter(cases.values()))["A"]
        config = _build_config(first, world)
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=world,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(tensor_model_parallel_size=world)
            for arch, paths in cases.items():
                results.put((rank, arch, _case(paths, world)))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        raise


def _build_config(path: str, tp: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=path,
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        tensor_parallel_size=tp,
    ).create_engine_config()
