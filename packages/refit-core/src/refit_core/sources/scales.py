"""How quantization scales travel with the tensors they scale.

Rule: a checkpoint tensor whose last name component is one of :data:`SCALE_SUFFIXES` (FP8
block scales ``weight_scale_inv`` / ``weight_scale``, activation scales ``input_scale`` /
``output_scale``, KV-cache scales ``k_scale`` / ``v_scale`` / ``kv_scale``) is a *companion*
of the ``weight`` of the same module: ``model.layers.0.self_attn.k_proj.k_scale`` rides with
``model.layers.0.self_attn.k_proj.weight``. A source never yields a companion on its own; it
puts it, under its checkpoint name and in its own dtype (never cast), into the owner's
``NamedTensor.metadata[SCALES_KEY]``, in the same bucket as the owner. A companion without an
owner in the same state is an error, and so is a companion whose owner is split or fused
(cutting block scales along with the rows is not supported).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from refit_core.types import NamedTensor

if TYPE_CHECKING:
    import torch

__all__ = ["SCALES_KEY", "SCALE_SUFFIXES", "checkpoint_items", "scale_owner"]

SCALES_KEY = "scales"
"""``NamedTensor.metadata`` key of a ``checkpoint name -> scale tensor`` mapping."""

SCALE_SUFFIXES = frozenset(
    {
        "weight_scale",
        "weight_scale_inv",
        "input_scale",
        "output_scale",
        "k_scale",
        "v_scale",
        "kv_scale",
    }
)


def scale_owner(name: str) -> str | None:
    """Checkpoint name of the tensor a scale companion rides with; None if ``name`` is no scale."""
    module, _, last = name.rpartition(".")
    if last not in SCALE_SUFFIXES:
        return None
    return f"{module}.weight" if module else "weight"


def checkpoint_items(tensors: Iterable[NamedTensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor, each one followed by its scale companions (what engines load)."""
    for named in tensors:
        yield named.name, named.tensor
        yield from named.metadata.get(SCALES_KEY, {}).items()
