"""Megatron-Core's own reshard of the test model, and the launcher that runs it beside refit's.

Oracle: every rank of a ``torch.distributed`` gloo world builds Megatron-Core's ``GPTModel``
(local spec, CPU) at a case's source layout, fills each parameter from the test's source
shards through Megatron's own sharded state dict (per-layer keys), saves it with
``dist_checkpointing.save``, rebuilds the model at the destination layout, loads the
checkpoint with ``dist_checkpointing.load`` and writes what Megatron-Core loaded for each
destination rank (data-parallel rank 0) to ``<out>/<case>/oracle<rank>.pt``. It also writes how
Megatron's own modules read the loaded fused weights (``<out>/<case>/split<rank>.pt``): the
query, key and value heads ``SelfAttention.get_query_key_value_tensors`` makes of
``linear_qkv`` and the gate and up halves of ``linear_fc1`` (``torch.chunk(x, 2, -1)``, as
``MLP.forward``'s gated unit), each fed the identity so the outputs are the weight rows.

What the oracle replaces in megatron-core 0.16.1 (none of it touches what is written):

- ``torch.cuda.synchronize`` (called after staging tensors to the CPU,
  ``strategies/filesystem_async.py``) is a no-op and ``torch.cuda.current_device`` (the device
  of the save's failure flag, ``strategies/state_dict_saver.py``) names the CPU: this torch
  has no CUDA.
- The queue that carries a rank's write results back from its writer processes
  (``filesystem_async._results_queue``) is served by a manager forked from the rank instead of
  a spawned one, which would import torch afresh to unpickle the results (about 9 s a rank on
  this machine).

``main(CASES_JSON, OUT_DIR)`` runs the oracle's ranks, then refit's
(:mod:`megatron_refit_ranks`), both forked from the calling process (:mod:`forked_ranks`);
``CASES_JSON`` is a list of ``{"name", "src", "dst" (Parallelism fields), "port" (refit's
group), "colocated"}``, the first with ``"oracle_port"`` too.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import multiprocessing
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from forked_ranks import run_ranks
from megatron_model import CONFIG, megatron_shard, natural_state
from megatron_refit_ranks import refit_rank
from megatron_workers import SEED, reshard_plan
from refit_nccl.megatron.gpt import Parallelism

ORACLE_WORLD = 4
"""Megatron's world: the widest layout (TP 4); narrower layouts add data-parallel replicas."""
PHASE_S = 60.0
"""Hard limit of one phase (save or load) of one case on one rank."""
RUN_S = 240.0
"""Limit of each set of ranks (the oracle's, then refit's)."""

Case = dict[str, Any]


def _patch_megatron() -> Any:
    """The CUDA calls of a save, and where its write results queue is served (module doc).

    Returns the manager serving the queue (shut it down when done).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    manager = multiprocessing.get_context("fork").Manager()
    filesystem_async._results_queue = manager.Queue()
    return manager


def _model(par: Parallelism) -> tuple[Any, dict[str, Any], int, bool]:
    """Megatron's GPT model at ``par``, its sharded state dict (tensors only), this rank's rank
    in refit's layout without data parallelism, and whether it is on data-parallel rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(par.tp, par.pp)
    config = TransformerConfig(
        num_layers=CONFIG.layers,
        hidden_size=CONFIG.hidden,
        num_attention_heads=CONFIG.heads,
        num_query_groups=CONFIG.query_groups,
        ffn_hidden_size=CONFIG.ffn,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        pipeline_dtype=torch.bfloat16,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=CONFIG.vocab,
        max_sequence_length=8,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    ).bfloat16()  # as Megatron's Float16Module: the norms too (RMSNorm keeps float32)
    sharded = model.sharded_state_dict(metadata={"non_homogeneous_layers": True})
    tensors = {k: v for k, v in sharded.items() if not isinstance(v, ShardedObject)}
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    return model, tensors, par.rank(tp_rank, 0, pp_rank), ps.get_data_parallel_rank() == 0


def _save(case: Case, out: Path) -> None:
    from megatron.core import dist_checkpointing

    src = Parallelism(**case["src"])
    _, sharded, rank, _ = _model(src)
    shard = megatron_shard(natural_state(CONFIG, SEED), CONFIG, src, rank)
    keys = {local: entry.key for local, entry in sharded.items()}
    if sorted(keys.values()) != sorted(shard):
        raise AssertionError(f"megatron holds {sorted(keys.values())}, the test {sorted(shard)}")
    with torch.no_grad():
        for local, key in keys.items():
            data = sharded[local].data
            if data.shape != shard[key].shape:
                raise AssertionError(f"{key}: megatron {data.shape}, test {shard[key].shape}")
            data.copy_(shard[key])
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(out / "ckpt"))


def _load(case: Case, out: Path) -> None:
    from megatron.core import dist_checkpointing

    model, sharded, rank, writes = _model(Parallelism(**case["dst"]))
    keys = {local: entry.key for local, entry in sharded.items()}
    with torch.no_grad():
        for entry in sharded.values():
            entry.data.zero_()
    loaded = dist_checkpointing.load(sharded, str(out / "ckpt"))
    model.load_state_dict(loaded, strict=False)
    if writes:
        torch.save({keys[k]: v for k, v in loaded.items()}, out / f"oracle{rank}.pt")
        torch.save(_split_by_megatron(model), out / f"split{rank}.pt")


@torch.no_grad()
def _split_by_megatron(model: Any) -> dict[str, torch.Tensor]:
    """``<layer>.<q|k|v|gate|up>`` -> this rank's rows of it, as Megatron's modules read them."""
    eye = torch.eye(CONFIG.hidden, dtype=torch.bfloat16).unsqueeze(1)  # [tokens, batch 1, hidden]
    out: dict[str, torch.Tensor] = {}
    for layer in model.decoder.layers:
        i = layer.layer_number - 1  # global, 1-based
        q, k, v = layer.self_attention.get_query_key_value_tensors(eye)
        fc1, _ = layer.mlp.linear_fc1(eye)
        gate, up = torch.chunk(fc1, 2, dim=-1)
        for name, rows in {"q": q, "k": k, "v": v, "gate": gate, "up": up}.items():
            out[f"{i}.{name}"] = rows.reshape(CONFIG.hidden, -1).T.contiguous()
    return out


def oracle_rank(rank: int, port: int, cases: list[Case], out_dir: Path) -> None:
    """One rank of the oracle: save and load every case."""
    manager = _patch_megatron()
    try:
        _run_cases(rank, port, cases, out_dir)
    finally:
        manager.shutdown()


def _run_cases(rank: int, port: int, cases: list[Case], out_dir: Path) -> None:
    started = time.monotonic()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ORACLE_WORLD,
        timeout=datetime.timedelta(seconds=PHASE_S),
    )
    print(f"rendezvous {time.monotonic() - started:.2f} s")
    for case in cases:
        for phase in (_save, _load):
            faulthandler.dump_traceback_later(PHASE_S, exit=True)
            started = time.monotonic()
            phase(case, out_dir / case["name"])
            print(f"{case['name']}: {phase.__name__[1:]} {time.monotonic() - started:.2f} s")
    faulthandler.cancel_dump_traceback_later()
    torch.distributed.destroy_process_group()


def main(cases_json: str, out_dir: str) -> None:
    """Run the oracle's ranks, then refit's, for every case."""
    warnings.simplefilter("ignore")  # megatron-core's notes on missing Apex / Transformer Engine
    # Imported once here (megatron-core takes ~18 s of CPU), inherited by every forked rank.
    import megatron.core.dist_checkpointing.strategies.torch
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    torch.set_num_threads(1)
    cases: list[Case] = json.loads(cases_json)
    out, port = Path(out_dir), cases[0]["oracle_port"]
    started = time.monotonic()
    run_ranks(ORACLE_WORLD, lambda r: oracle_rank(r, port, cases, out), out, "oracle", RUN_S)
    world = max(reshard_plan(case).world_size for case in cases)
    reshard_started = time.monotonic()
    run_ranks(world, lambda r: refit_rank(r, cases, out), out, "refit", RUN_S)
    took = f"oracle {reshard_started - started:.1f} s, refit {time.monotonic() - reshard_started:.1f} s"
    print(took, flush=True)
