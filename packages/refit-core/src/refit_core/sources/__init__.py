"""Trainer-side weight sources: a bounded-memory stream of checkpoint-named tensors.

torch is imported only inside the functions that need it, so ``import refit_core`` stays
light. One module per job:

- :mod:`.protocol`: ``WeightSource`` (what every synchronizer consumes), ``ShardedWeightSource``
  (a source whose iteration runs collectives: FSDP2 here, Megatron in refit-nccl) and ``Bucket``;
- :mod:`.plain`: ``StateDictSource`` over a local module or state dict;
- :mod:`.dtensor`: ``DTensorSource`` over FSDP2 / DTensor state, gathered bucket by bucket;
- :mod:`.ordering`: the guard that keeps gathers and the consumer's collectives in order;
- :mod:`.name_map`: trainer names -> checkpoint names (renames, splits, fuses);
- :mod:`.cast`: the one cast to the engine's dtype;
- :mod:`.scales`: how quantization scales ride with their tensors;
- :mod:`.plan`: the unit and bucket plan every source follows.
"""

from refit_core.sources.dtensor import DTensorSource
from refit_core.sources.name_map import (
    GATE_UP_FUSE,
    GATE_UP_SPLIT,
    QKV_FUSE,
    FuseRule,
    NameMap,
    Rename,
    SplitRule,
    qkv_split,
)
from refit_core.sources.ordering import CollectiveOrderError, CollectiveOrderGuard
from refit_core.sources.plain import StateDictSource
from refit_core.sources.protocol import Bucket, ShardedWeightSource, WeightSource
from refit_core.sources.scales import SCALE_SUFFIXES, SCALES_KEY, checkpoint_items

__all__ = [
    "GATE_UP_FUSE",
    "GATE_UP_SPLIT",
    "QKV_FUSE",
    "SCALES_KEY",
    "SCALE_SUFFIXES",
    "Bucket",
    "CollectiveOrderError",
    "CollectiveOrderGuard",
    "DTensorSource",
    "FuseRule",
    "NameMap",
    "Rename",
    "ShardedWeightSource",
    "SplitRule",
    "StateDictSource",
    "WeightSource",
    "checkpoint_items",
    "qkv_split",
]
