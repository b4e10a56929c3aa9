"""The in-place sparse path against vLLM's real loaders: on vLLM's Qwen2 and Llama model classes
built without the CPU repacking (as unquantized weights are on a GPU), at tensor-parallel size 2
(row slices of fused q/k/v and gate/up, column slices of o and down, vocabulary slices with
padding, replicated norms and KV heads), the write map places every checkpoint tensor in place,
and real delta payloads written through it leave every runtime parameter bit for bit equal to a
model vLLM loaded fresh from the target checkpoint; a rolled-back transfer and an undone write
leave the previous bits (``write_map_ranks.py`` runs the ranks). Size 1 (whole tensors) runs in
``refit bench vllm``'s in-place part, with the same checks."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import perturb
from write_map_ranks import run_rank

from refit_lab.ray_cluster import free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

_SHAPES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "vocab_size": 1000,  # vLLM pads it to 1024: padding rows the map must account for
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _write(root: Path, arch: str) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "qwen2":  # biased q/k/v fused into qkv_proj, two KV heads split over ranks
        config: Any = Qwen2Config(**_SHAPES, num_key_value_heads=2)
        model_class: Any = Qwen2ForCausalLM
    else:  # one KV head: replicated on both ranks
        config = LlamaConfig(**_SHAPES, num_key_value_heads=1)
        model_class = LlamaForCausalLM
    torch.manual_seed(11)
    model = model_class(config).to(torch.bfloat16)
    states = {"A": {n: t.detach().clone() for n, t in model.state_dict().items()}}
    states["A1"] = perturb(states["A"], seed=12)
    states["A2"] = perturb(states["A1"], seed=13)
    paths = {}
    for state, tensors in states.items():
        model.load_state_dict(tensors)
        path = root / f"{arch}-{state}"
        model.save_pretrained(path)
        paths[state] = str(path)
    return paths


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    root = Path(tmp_path_factory.mktemp("write-map"))
    return {arch: _write(root, arch) for arch in ("qwen2", "llama")}


def test_deltas_written_in_place_equal_vllms_own_load(cases: dict[str, dict[str, str]]) -> None:
    pytest.importorskip("vllm")
    tp = 2
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=run_rank, args=(r, tp, port, cases, results), daemon=True)
        for r in range(tp)
    ]
    for process in ranks:
        process.start()
    try:
        reports = [results.get(timeout=600) for _ in range(tp * len(cases))]
    finally:
        for process in ranks:
            process.join(60)
            process.kill()
    errors = [r for r in reports if r[1] == "error"]
    assert not errors, errors
    assert sorted((r[0], r[1]) for r in reports) == sorted(
        (rank, arch) for rank in range(tp) for arch in cases
    )
    for rank, arch, report in reports:
        where = f"{arch} rank {rank}/{tp}"
        assert report["changed_params"] > 0, where
        assert report["shadowed"] == [], f"{where}: {report['reasons']}"
        assert report["resync_payloads"] > 2 and report["delta_payloads"] >= 1, where
        assert report["after_resync"] == (1, []), where
        assert report["after_rollback"] == ([], []), where
        assert report["after_delta"] == (2, []), where
        assert report["delta_writes"] > 0, where
        assert report["written"] == [], f"{where}: the A2 -> A1 writes reach every parameter"
        assert report["after_undo"] == [], where
