"""Worker processes of the MegatronSource tests (imported by name in spawned children).

The oracle is independent of the source: the HF twin is written straight from the natural
(unfused) tensors of :func:`megatron_model.natural_state`, the shards are cut from the same
tensors by :func:`megatron_model.megatron_shard`, neither through the source's gather.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from megatron_model import CONFIG, MOE, Natural, megatron_shard, natural_state
from nccl_workers import SETUP_S, Report, bitwise_differences, connect
from refit_core import GeometryMismatchError, RefitError
from refit_core.backend import CollectiveSenderSpec
from refit_core.sources import StateDictSource
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_nccl.group.spec import GroupSpec
from refit_nccl.megatron import GPTConfig, MegatronSource, Parallelism
from refit_nccl.roles.contract import JoinRequest
from refit_nccl.roles.engine import EngineEndpoint
from refit_nccl.roles.trainer import TrainerEndpoint

SEED = 5
GEOMETRY = CollectiveSenderSpec("refit", 1 << 20, 2)
REFIT_CONFIG = GPTConfig(layers=2, hidden=256, heads=8, query_groups=4, ffn=512, vocab=512)
"""About 3 MiB in bf16: the refit interleaves several broadcasts with the gathers."""


def masters(config: GPTConfig, seed: int) -> Natural:
    """fp32 masters a small step away from every bf16 value of the natural state."""
    g = torch.Generator().manual_seed(seed + 1000)
    return {
        name: t.float() + 1e-3 * torch.randn(t.shape, generator=g)
        for name, t in natural_state(config, seed).items()
    }


def hf_twin(state: Natural, config: GPTConfig) -> dict[str, torch.Tensor]:
    """The unsharded model's HF checkpoint, in checkpoint order, from the natural tensors."""
    twin = {"model.embed_tokens.weight": state["embedding"]}
    for i in range(config.layers):
        pre = f"model.layers.{i}."
        twin |= {
            pre + "input_layernorm.weight": state[f"{i}.qkv_norm"],
            pre + "self_attn.q_proj.weight": state[f"{i}.q"],
            pre + "self_attn.k_proj.weight": state[f"{i}.k"],
            pre + "self_attn.v_proj.weight": state[f"{i}.v"],
            pre + "self_attn.o_proj.weight": state[f"{i}.proj"],
            pre + "post_attention_layernorm.weight": state[f"{i}.mlp_norm"],
        }
        mlps = {pre + "mlp.": f"{i}.mlp"}
        if config.experts:
            twin[pre + "mlp.gate.weight"] = state[f"{i}.router"]
            mlps = {f"{pre}mlp.experts.{e}.": f"{i}.e{e}" for e in range(config.experts)}
        for prefix, key in mlps.items():
            twin |= {
                prefix + "gate_proj.weight": state[f"{key}.gate"],
                prefix + "up_proj.weight": state[f"{key}.up"],
                prefix + "down_proj.weight": state[f"{key}.fc2"],
            }
    twin["model.norm.weight"] = state["final_norm"]
    twin["lm_head.weight"] = state["output"]
    return twin


def engine_config(config: GPTConfig) -> ReferenceModelConfig:
    """The reference engine (bf16) of the dense GPT config."""
    return ReferenceModelConfig(
        vocab_size=config.vocab,
        hidden_size=config.hidden,
        num_layers=config.layers,
        num_heads=config.heads,
        num_kv_heads=config.query_groups,
        intermediate_size=config.ffn,
    )


def engine_digest(config: GPTConfig, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
    engine = ReferenceEngine(engine_config(config))
    engine.load_weights(weights)
    return engine.combined_digest()


def _shards(step: Report, config: GPTConfig, state: Natural, rank: int) -> Natural:
    """This rank's shards, spoiled as the step says (``drop`` / ``narrow``: a rank)."""
    shards = megatron_shard(state, config, Parallelism(**step["par"]), rank)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    if step.get("drop") == rank:
        del shards[name]
    if step.get("narrow") == rank:
        shards[name] = shards[name][1:]
    return shards


def _stream(proc: int, step: Report) -> Report | None:
    """Stream the source at each bucket size; compare the sender's tensors with the twin."""
    par = Parallelism(**step["par"])
    if proc >= par.world_size:
        return None
    config = MOE if step.get("moe") else CONFIG
    fp32 = step.get("fp32", False)
    state = masters(config, SEED) if fp32 else natural_state(config, SEED)
    twin = {n: t.to(torch.bfloat16) for n, t in hf_twin(state, config).items()}
    shards = _shards(step, config, state, proc)
    group = connect(proc, par.world_size, step["port"], name=step["name"])
    if step.get("absent") == proc:  # alive, but never iterates: its peers must time out
        time.sleep(step["timeout_s"] + 2)
        group.abort("test done")
        return {"error": None, "absent": True}
    sender = step.get("sender", 0)
    report: Report = {"error": None, "wrong": [], "kept": 0, "digests_equal": True}
    started = time.monotonic()
    try:
        for bucket_bytes in (None, 1024, 1 << 30):
            source = MegatronSource(
                config, par, lambda: shards, group,
                params_dtype="float32" if fp32 else "bfloat16",
                dtype="bfloat16" if fp32 else None,
                bucket_size_bytes=bucket_bytes, sender_rank=sender,
                gather_timeout_s=step.get("timeout_s", SETUP_S),
            )  # fmt: skip
            buckets = list(source.iter_buckets())
            streamed = {t.name: t.tensor for b in buckets for t in b.tensors}
            if proc != sender:
                report["kept"] += len(streamed)
                continue
            order = list(streamed) == list(twin) == list(source.state_dict_info())
            report["wrong"] += [f"{bucket_bytes}: {n}" for n in bitwise_differences(twin, streamed)]
            report["wrong"] += [] if order else [f"{bucket_bytes}: order"]
            report[f"buckets {bucket_bytes}"] = len(buckets)
            if not config.experts:
                same = engine_digest(config, streamed.items()) == engine_digest(
                    config, twin.items()
                )
                report["digests_equal"] &= same
    except RefitError as exc:
        report = {"error": type(exc).__name__, "message": str(exc)}
    report["elapsed_s"] = time.monotonic() - started
    group.abort("test done")
    return report


class _Policy:
    """A PolicyLike over a MegatronSource."""

    def __init__(self, source: MegatronSource) -> None:
        self.source = source

    def weight_source(self) -> MegatronSource:
        return self.source


def _refit(proc: int, step: Report) -> Report | None:
    """Trainer ranks 0 and 1 (TP 2) gather; rank 0 refits an engine process (proc 2) over a
    separate collective group at the same time; rank 1 drives its gathers alone."""
    par = Parallelism(tp=2)
    state = natural_state(REFIT_CONFIG, SEED)
    twin = hf_twin(state, REFIT_CONFIG)
    timeout_s = SETUP_S
    if proc > 2:
        return None
    if proc == 2:
        engine = ReferenceEngine(engine_config(REFIT_CONFIG))
        endpoint = EngineEndpoint(lambda: engine, GEOMETRY)
        items = tuple(StateDictSource(twin).state_dict_info().items())
        spec = GroupSpec("127.0.0.1", step["refit_port"], 1, 2, name=step["name"])
        endpoint.refit_join(JoinRequest(spec, items, GEOMETRY, timeout_s))
        stats = endpoint.refit_transfer(1, timeout_s)
        endpoint.refit_commit(1)
        same = engine.combined_digest() == engine_digest(REFIT_CONFIG, twin.items())
        return {"error": None, "digest_equal": same, "buckets": stats.buckets}
    shards = megatron_shard(state, REFIT_CONFIG, par, proc)
    group = connect(proc, 2, step["port"], name=step["name"] + "-gather")
    source = MegatronSource(REFIT_CONFIG, par, lambda: shards, group, gather_timeout_s=timeout_s)
    report: Report = {"error": None}
    if proc == 0:
        trainer = TrainerEndpoint(_Policy(source))
        spec = GroupSpec("127.0.0.1", step["refit_port"], 0, 2, name=step["name"])
        trainer.refit_join(JoinRequest(spec, trainer.refit_state(), GEOMETRY, timeout_s))
        report["buckets"] = trainer.refit_transfer(1, timeout_s).buckets
    else:
        report["kept"] = sum(len(b.tensors) for b in source.iter_buckets())
    group.abort("test done")
    return report


def run(results: Any, proc: int, steps: list[Report]) -> None:
    """Process entry point: run each step this process takes part in; put one report each."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    for step in steps:
        try:
            report = _refit(proc, step) if step.get("refit") else _stream(proc, step)
        except (RefitError, GeometryMismatchError, ValueError) as exc:
            report = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:
            report = {"error": "crash", "message": f"{type(exc).__name__}: {exc}"}
        if report is not None:
            results.put({"proc": proc, "step": step["name"], **report})
