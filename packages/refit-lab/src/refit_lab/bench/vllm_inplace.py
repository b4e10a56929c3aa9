"""The in-place sparse path of ``refit bench vllm``, measured on vLLM's own model class built
without the CPU repacking (as unquantized weights are on a GPU), in a child process with vLLM's
parallel state of one rank.

The model is loaded by vLLM's own loader from S0 and never processed
(``process_weights_after_loading`` is what repacks on CPU), so its parameters are plain
tensors that vLLM's ``load_checkpoint_weight_patches`` writes as it would on a GPU. Rounds
alternate the target (S1, S0, ...); each times, on the same model in the same round:

* refit: the delta's payloads (refit's producer, ``DeltaCompressionTracker``) staged by the
  receiver (``StagedDeltas``: decoded, positions through the write map) and written in place
  (``CheckpointTargets.apply``, with undo); the staging is timed apart (on a GPU engine it
  overlaps the transfer);
* vLLM's ``load_checkpoint_weight_patches`` with the same changed elements, back to the other
  state;
* a full load of the target through the model's ``load_weights`` (what vLLM's loader does at
  start, without the processing).

After each, every checkpoint tensor read back from the runtime parameters through the map must
equal the target's bits.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["measure_in_place"]


def _config(path: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=path,
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
    ).create_engine_config()


def _model(config: Any) -> tuple[Any, Any]:
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    loader = get_model_loader(config.load_config)
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        model = initialize_model(vllm_config=config)
    loader.load_weights(model, config.model_config)
    return model, loader


def _states(paths: Mapping[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file  # type: ignore[import-not-found]  # vLLM brings it

    return {s: load_file(os.path.join(p, "model.safetensors")) for s, p in paths.items()}


def measure_in_place(paths: Mapping[str, str], rounds: int, threads: int) -> dict[str, Any]:
    """Child process: the rounds described in the module docstring; per-round seconds and
    whether every check held."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from refit_core import TensorSpec, WeightVersion
    from refit_core.backend import checkpoint_specs
    from refit_core.vllm.write_map import capture_write_map
    from refit_lab.ray_cluster import free_port
    from refit_zmq.tracker import DeltaCompressionTracker
    from refit_zmq.vllm.delta_receiver import StagedDeltas
    from refit_zmq.vllm.targets import CheckpointTargets, plan_targets

    torch.set_num_threads(threads)
    config = _config(paths["S0"])
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=1)
        model, loader = _model(config)
    states = _states(paths)
    specs = {
        n: (s, getattr(torch, d)) for n, (s, d) in checkpoint_specs(paths["S0"], "bfloat16").items()
    }
    found = capture_write_map(model, specs)
    plan = plan_targets(
        model, found, specs, lambda: loader.get_all_weights(config.model_config, model)
    )
    targets = CheckpointTargets(model, plan, {})
    deltas = StagedDeltas(targets, specs, version=0)
    tracker = DeltaCompressionTracker({n: TensorSpec.of(t) for n, t in states["S0"].items()})
    tracker.load_baseline(states["S0"], WeightVersion(0))

    def holds(state: str) -> bool:
        return all(
            torch.equal(targets.checkpoint_tensor(n).view(torch.int16), t.view(torch.int16))
            for n, t in states[state].items()
        )

    exact = holds("S0") and not plan.shadowed
    rows = []
    current = "S0"
    for index in range(rounds):
        target = "S1" if current == "S0" else "S0"
        payloads = [
            memoryview(b"".join(bytes(memoryview(f).cast("B")) for f in p.frames))
            for p in tracker.encode(states[target], WeightVersion(index + 1))
        ]
        started = time.perf_counter()
        for body in payloads:
            deltas.apply(body, {"transfer_id": f"t{index}"})
        deltas.commit(f"t{index}")
        staged = time.perf_counter()
        version, writes = deltas.take_committed()
        targets.apply(writes).discard()
        applied = time.perf_counter()
        tracker.commit()
        exact &= version == index + 1 and holds(target)

        other = current
        patches = []
        for name, new in states[other].items():
            old = states[target][name]
            indices = (
                (old.view(torch.int16) != new.view(torch.int16)).reshape(-1).nonzero().reshape(-1)
            )
            patches.append(
                CheckpointWeightPatch(
                    name, tuple(new.shape), new.dtype, new.reshape(-1)[indices], indices
                )
            )
        patch_started = time.perf_counter()
        with set_current_vllm_config(config):
            load_checkpoint_weight_patches(model, patches)
        patched = time.perf_counter()
        exact &= holds(other)

        load_started = time.perf_counter()
        with set_current_vllm_config(config):
            model.load_weights(iter(states[target].items()))
        loaded = time.perf_counter()
        exact &= holds(target)
        current = target
        rows.append(
            {
                "stage_s": staged - started,
                "apply_s": applied - staged,
                "vllm_patches_s": patched - patch_started,
                "full_load_s": loaded - load_started,
                "writes": len(writes),
                "elements": sum(w.values.numel() for w in writes),
            }
        )
    return {
        "rows": rows,
        "exact": exact,
        "in_place_bytes": targets.in_place_bytes,
        "apply_vs_vllm_patches": statistics.median(
            r["apply_s"] / r["vllm_patches_s"] for r in rows
        ),
        "apply_vs_full_load": statistics.median(r["apply_s"] / r["full_load_s"] for r in rows),
        "stage_and_apply_vs_vllm_patches": statistics.median(
            (r["stage_s"] + r["apply_s"]) / r["vllm_patches_s"] for r in rows
        ),
    }
