"""Trainer parameter names -> engine checkpoint names: renames, splits and fuses.

A :class:`NameMap` first renames every trainer name one to one, then applies at most one
split or fuse rule to the renamed name. Rules match whole dotted components of a name
(``self_attn.qkv_proj`` matches ``model.layers.3.self_attn.qkv_proj.weight`` and its
``.bias``) and cut or join contiguous row blocks along dim 0, the layout of HF checkpoints
and vLLM's fused layers (``qkv_proj`` = q rows, then k rows, then v rows; ``gate_up_proj`` =
gate rows, then up rows). Interleaved layouts (Megatron's per-group qkv) are the Megatron
source's business, not a rule's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "GATE_UP_FUSE",
    "GATE_UP_SPLIT",
    "QKV_FUSE",
    "FuseRule",
    "NameMap",
    "Rename",
    "SplitRule",
    "as_name_map",
    "qkv_split",
]

Rename = Callable[[str], str]
"""A one-to-one rename of a trainer name (the plain ``name_map`` callable of earlier versions)."""


def _splice(name: str, fragment: str) -> tuple[str, str] | None:
    """``(before, after)`` around the first whole-component match of ``fragment``, or None."""
    parts, target = name.split("."), fragment.split(".")
    width = len(target)
    for start in range(len(parts) - width + 1):
        if parts[start : start + width] == target:
            before = "".join(f"{p}." for p in parts[:start])
            after = "".join(f".{p}" for p in parts[start + width :])
            return before, after
    return None


@dataclass(frozen=True)
class SplitRule:
    """One trainer tensor whose ``fused`` component becomes ``parts``, cut along dim 0.

    Attributes:
        fused: the dotted component(s) to match, e.g. ``"self_attn.qkv_proj"``.
        parts: replacements, in row order, e.g. ``("self_attn.q_proj", ...)``.
        sizes: rows of each part; None cuts into equal parts.
    """

    fused: str
    parts: tuple[str, ...]
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"a split needs at least two parts, got {self.parts}")
        if self.sizes is not None and (
            len(self.sizes) != len(self.parts) or any(s <= 0 for s in self.sizes)
        ):
            raise ValueError(f"sizes {self.sizes} must be positive, one per part {self.parts}")

    def part_rows(self, name: str, rows: int) -> tuple[int, ...]:
        """Rows of each part of ``name``, a fused tensor of ``rows`` rows."""
        if self.sizes is None:
            if rows % len(self.parts):
                raise ValueError(f"{name!r}: {rows} rows do not split into {len(self.parts)}")
            return (rows // len(self.parts),) * len(self.parts)
        if sum(self.sizes) != rows:
            raise ValueError(f"{name!r}: {rows} rows, but the split sizes are {self.sizes}")
        return self.sizes


@dataclass(frozen=True)
class FuseRule:
    """Trainer tensors whose ``parts`` components join, in that row order, into ``fused``."""

    parts: tuple[str, ...]
    fused: str

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len(set(self.parts)) != len(self.parts):
            raise ValueError(f"a fuse needs at least two distinct parts, got {self.parts}")


QKV_FUSE = FuseRule(
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.qkv_proj"
)
"""HF ``q_proj`` / ``k_proj`` / ``v_proj`` -> vLLM's fused ``qkv_proj``."""

GATE_UP_FUSE = FuseRule(("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj")
"""HF ``gate_proj`` / ``up_proj`` -> vLLM's fused ``gate_up_proj``."""

GATE_UP_SPLIT = SplitRule("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))
"""A fused ``gate_up_proj`` -> HF ``gate_proj`` / ``up_proj`` (equal halves)."""


def qkv_split(q_rows: int, kv_rows: int) -> SplitRule:
    """A fused ``qkv_proj`` -> HF ``q_proj`` / ``k_proj`` / ``v_proj`` (GQA: ``kv_rows`` each)."""
    return SplitRule(QKV_FUSE.fused, QKV_FUSE.parts, (q_rows, kv_rows, kv_rows))


@dataclass(frozen=True)
class NameMap:
    """Renames, then splits or fuses, trainer names into checkpoint names.

    Attributes:
        rename: one-to-one trainer -> checkpoint rename, applied first; None keeps names.
        splits: rules cutting one renamed tensor into several.
        fuses: rules joining several renamed tensors into one.
    """

    rename: Rename | None = None
    splits: tuple[SplitRule, ...] = ()
    fuses: tuple[FuseRule, ...] = ()

    def renamed(self, name: str) -> str:
        """The checkpoint-vocabulary name of trainer tensor ``name``."""
        return self.rename(name) if self.rename is not None else name

    def split_of(self, name: str) -> tuple[SplitRule, tuple[str, ...]] | None:
        """The first split rule matching renamed ``name`` and the part names, or None."""
        for rule in self.splits:
            around = _splice(name, rule.fused)
            if around is not None:
                before, after = around
                return rule, tuple(f"{before}{part}{after}" for part in rule.parts)
        return None

    def fuse_of(self, name: str) -> tuple[str, int, int] | None:
        """``(fused name, part index, part count)`` of the first fuse rule matching, or None."""
        for rule in self.fuses:
            for index, part in enumerate(rule.parts):
                around = _splice(name, part)
                if around is not None:
                    before, after = around
                    return f"{before}{rule.fused}{after}", index, len(rule.parts)
        return None


def as_name_map(name_map: NameMap | Rename | None) -> NameMap:
    """A :class:`NameMap` from a map, a plain rename callable, or None (identity)."""
    if name_map is None:
        return NameMap()
    if isinstance(name_map, NameMap):
        return name_map
    return NameMap(rename=name_map)
