"""The README's "Wiring your trainer in" examples, run as written."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from refit_core import create_weight_synchronizer
from refit_core.protocols import PolicyLike
from refit_core.sources import ShardedWeightSource
from refit_lab.reference_engine import (
    ReferenceEngine,
    ReferenceModel,
    ReferenceModelConfig,
    checkpoint_tensor_specs,
    random_checkpoint,
)

README = Path(__file__).resolve().parents[1] / "README.md"
CONFIG = ReferenceModelConfig(vocab_size=32, hidden_size=16, num_heads=4, num_kv_heads=2)


def _section() -> str:
    text = README.read_text()
    return text.split("## Wiring your trainer in", 1)[1].split("\n## ", 1)[0]


def _examples() -> dict[str, Any]:
    """Run every python block of the section in one namespace; return the namespace.

    The Megatron block imports refit-nccl, which refit-core's isolated install lacks."""
    pytest.importorskip("refit_nccl")
    blocks = re.findall(r"```python\n(.*?)```", _section(), re.DOTALL)
    assert len(blocks) == 4
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    return namespace


def _model() -> ReferenceModel:
    model = ReferenceModel(CONFIG)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


def _loaded(policy: Any) -> ReferenceEngine:
    assert isinstance(policy, PolicyLike)
    source = policy.weight_source()
    assert list(source.state_dict_info()) == list(checkpoint_tensor_specs(CONFIG))
    engine = ReferenceEngine(CONFIG)
    engine.load_weights((t.name, t.tensor) for t in source.iter_tensors())
    return engine


def test_the_plain_policy_feeds_the_engine_its_checkpoint_cast_once() -> None:
    checkpoint = random_checkpoint(CONFIG, seed=2)
    policy = _examples()["Policy"]({n: t.float() for n, t in checkpoint.items()})
    assert not isinstance(policy.weight_source(), ShardedWeightSource)
    twin = ReferenceEngine(CONFIG)
    twin.load_weights(checkpoint.items())
    assert _loaded(policy).combined_digest() == twin.combined_digest()


def test_the_fsdp_policy_splits_the_fused_model_into_the_engines_checkpoint() -> None:
    model = _model()
    head = CONFIG.head_dim
    policy = _examples()["FSDPPolicy"](model, CONFIG.num_heads * head, CONFIG.num_kv_heads * head)
    assert isinstance(policy.weight_source(), ShardedWeightSource)
    engine = _loaded(policy)
    fused = engine.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(fused[name], tensor.to(torch.bfloat16)), name


def test_megatron_policy_streams_hf_names_on_one_rank() -> None:
    pytest.importorskip("refit_nccl.megatron")
    from refit_core.backend import Deadline
    from refit_lab.ray_cluster import free_port
    from refit_nccl.backend import AbortableProcessGroup, GroupSpec
    from refit_nccl.megatron import GPTConfig, Parallelism, gpt_layouts

    config = GPTConfig(layers=2, hidden=16, heads=4, query_groups=2, ffn=24, vocab=32, itemsize=4)
    generator = torch.Generator().manual_seed(4)
    shards = {
        name: torch.randn(layout.shape, generator=generator)
        for name, layout in gpt_layouts(config, Parallelism()).items()
    }
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1, name="readme"))
    group.connect(Deadline.after(30))
    try:
        policy = _examples()["MegatronPolicy"](config, Parallelism(), lambda: shards, group)
        assert isinstance(policy, PolicyLike)
        streamed = {t.name: t.tensor for t in policy.weight_source().iter_tensors()}
    finally:
        group.abort("test done")
    specs = checkpoint_tensor_specs(CONFIG)
    assert list(streamed) == list(specs)
    assert {t.dtype for t in streamed.values()} == {torch.bfloat16}
    down = shards["decoder.layers.1.mlp.linear_fc2.weight"].to(torch.bfloat16)
    assert torch.equal(streamed["model.layers.1.mlp.down_proj.weight"], down)


def test_the_refit_loop_calls_the_factory_with_its_real_signature() -> None:
    call = re.search(r"create_weight_synchronizer\((.*?)\)\n", _section(), re.DOTALL)
    assert call is not None
    arguments = [a.strip() for a in call.group(1).split(",") if a.strip()]
    keywords = {a.split("=")[0]: None for a in arguments if "=" in a}
    positional = [a for a in arguments if "=" not in a]
    bound = inspect.signature(create_weight_synchronizer).bind(*positional, **keywords)
    assert set(bound.arguments) >= {"policy", "generation", "generation_backend", "colocated"}


def test_the_refit_loop_drives_a_sharded_source_on_other_ranks() -> None:
    examples = _examples()
    head = CONFIG.head_dim
    policy = examples["FSDPPolicy"](_model(), CONFIG.num_heads * head, CONFIG.num_kv_heads * head)
    steps: list[int] = []
    loop = examples["refit_after_each_step"]
    loop(policy, None, None, rank=1, train_step=lambda: steps.append(1), steps=2)
    assert steps == [1, 1]
