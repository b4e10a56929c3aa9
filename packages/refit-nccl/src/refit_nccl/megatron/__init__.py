"""Megatron reshard (plan and run the copies from a training layout to an inference layout)
and the Megatron source (TP / PP shards gathered into HF checkpoint tensors).

Installed by ``refit-nccl[megatron]``; nothing here imports megatron-core, and
``import refit_nccl`` does not import this package.
"""

from refit_nccl.megatron.builder import (
    MegatronSide,
    build_collective_reshard,
    build_colocated_reshard,
)
from refit_nccl.megatron.executor import ReshardStats, execute_reshard
from refit_nccl.megatron.gpt import GPTConfig, Parallelism, gpt_layouts
from refit_nccl.megatron.hf import hf_name, hf_name_map
from refit_nccl.megatron.layout import ParamLayout, Span
from refit_nccl.megatron.plan import Copy, ReshardPlan, plan_reshard
from refit_nccl.megatron.source import MegatronSource
from refit_nccl.megatron.synchronizer import MegatronWeightSynchronizer, Rendezvous, Shards

__all__ = [
    "Copy",
    "GPTConfig",
    "MegatronSide",
    "MegatronSource",
    "MegatronWeightSynchronizer",
    "Parallelism",
    "ParamLayout",
    "Rendezvous",
    "ReshardPlan",
    "ReshardStats",
    "Shards",
    "Span",
    "build_collective_reshard",
    "build_colocated_reshard",
    "execute_reshard",
    "gpt_layouts",
    "hf_name",
    "hf_name_map",
    "plan_reshard",
]
