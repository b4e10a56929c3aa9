"""The transfer plan every source follows: units of trainer tensors -> checkpoint tensors.

A plan is built from names, shapes and dtypes alone (no tensor data, no collective), so every
rank derives the same plan from the same state. A *unit* is what must be read together: one
trainer tensor (copied or split), or the parts of one fuse, plus the scale companions that
ride with its output. Sources cast each input once (:mod:`refit_core.sources.cast`), then
:func:`materialize` a unit into ``NamedTensor`` s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from refit_core.sources.cast import cast_target, check_engine_dtype
from refit_core.sources.name_map import NameMap
from refit_core.sources.scales import SCALES_KEY, scale_owner
from refit_core.types import NamedTensor, StateDictInfo, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "Unit",
    "build_plan",
    "fingerprint",
    "materialize",
    "pack_buckets",
    "plan_info",
    "state_plan",
    "state_tensors",
]

_NO_METADATA: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Unit:
    """Trainer tensors read together and the checkpoint tensors they become.

    Attributes:
        inputs: ``(trainer name, dtype it is cast to)``: the main inputs (one, or the fused
            parts in row order), then the scale companions.
        outputs: ``(checkpoint name, spec)`` of each main output, in row order.
        companions: ``(checkpoint name, spec)`` of each scale companion, aligned with the
            last ``len(companions)`` inputs.
        split_rows: rows of each output when one input is split; empty otherwise.
    """

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, TensorSpec], ...]
    companions: tuple[tuple[str, TensorSpec], ...] = ()
    split_rows: tuple[int, ...] = ()

    @property
    def info(self) -> tuple[tuple[str, TensorSpec], ...]:
        """Every checkpoint tensor of the unit, companions after their owner."""
        return self.outputs + self.companions

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's checkpoint tensors in the engine's dtypes."""
        import torch

        return sum(spec.numel * getattr(torch, spec.dtype).itemsize for _, spec in self.info)


@dataclass
class _Fuse:
    """Parts of one fuse gathered while planning: part index -> (trainer name, spec)."""

    count: int
    parts: dict[int, tuple[str, TensorSpec]]


def _cast_spec(spec: TensorSpec, engine_dtype: str | None, rows: int | None = None) -> TensorSpec:
    shape = spec.shape if rows is None else (rows, *spec.shape[1:])
    return TensorSpec(shape, cast_target(spec.dtype, engine_dtype))


def _rows(name: str, spec: TensorSpec) -> int:
    if not spec.shape:
        raise ValueError(f"{name!r} is a scalar; only tensors with rows can be split or fused")
    return spec.shape[0]


def _fused_unit(fused: str, group: _Fuse, engine_dtype: str | None) -> Unit:
    missing = sorted(set(range(group.count)) - set(group.parts))
    if missing:
        raise ValueError(f"fuse into {fused!r} lacks part(s) {missing}")
    parts = [group.parts[index] for index in range(group.count)]
    first = parts[0][1]
    for name, spec in parts:
        if spec.shape[1:] != first.shape[1:] or spec.dtype != first.dtype:
            raise ValueError(f"fuse into {fused!r}: {name!r} is {spec}, unlike {first}")
    rows = sum(_rows(name, spec) for name, spec in parts)
    return Unit(
        inputs=tuple((name, cast_target(spec.dtype, engine_dtype)) for name, spec in parts),
        outputs=((fused, _cast_spec(first, engine_dtype, rows)),),
    )


def build_plan(
    specs: Iterable[tuple[str, TensorSpec]], name_map: NameMap, engine_dtype: str | None
) -> tuple[Unit, ...]:
    """Units, in the order their first input appears in ``specs``; raises ValueError on a
    name collision, an incomplete or mismatched fuse, a bad split, or an orphan scale."""
    check_engine_dtype(engine_dtype)
    order: list[Unit | str] = []
    fuses: dict[str, _Fuse] = {}
    scales: dict[str, list[tuple[str, str, TensorSpec]]] = {}
    for trainer_name, spec in specs:
        name = name_map.renamed(trainer_name)
        owner = scale_owner(name)
        if owner is not None:
            scales.setdefault(owner, []).append((trainer_name, name, spec))
            continue
        split, fuse = name_map.split_of(name), name_map.fuse_of(name)
        if split is not None and fuse is not None:
            raise ValueError(f"{trainer_name!r} matches both a split and a fuse rule")
        target = cast_target(spec.dtype, engine_dtype)
        if split is not None:
            rule, names = split
            rows = rule.part_rows(name, _rows(name, spec))
            outputs = tuple(
                (part, _cast_spec(spec, engine_dtype, r))
                for part, r in zip(names, rows, strict=True)
            )
            order.append(Unit(((trainer_name, target),), outputs, split_rows=rows))
        elif fuse is not None:
            fused, index, count = fuse
            if fused not in fuses:
                fuses[fused] = _Fuse(count, {})
                order.append(fused)
            group = fuses[fused]
            if index in group.parts:
                raise ValueError(f"name map sends two tensors to part {index} of {fused!r}")
            group.parts[index] = (trainer_name, spec)
        else:
            order.append(Unit(((trainer_name, target),), ((name, _cast_spec(spec, engine_dtype)),)))
    units = [
        _fused_unit(item, fuses[item], engine_dtype) if isinstance(item, str) else item
        for item in order
    ]
    return _attach_scales(units, scales)


def _attach_scales(
    units: list[Unit], scales: Mapping[str, list[tuple[str, str, TensorSpec]]]
) -> tuple[Unit, ...]:
    """Units with their scale companions attached; refuses orphans and duplicate names."""
    attached: list[Unit] = []
    seen: set[str] = set()
    for unit in units:
        owner = unit.outputs[0][0]
        riders = scales.get(owner, []) if len(unit.outputs) == 1 and len(unit.inputs) == 1 else []
        if riders:
            unit = Unit(
                inputs=unit.inputs + tuple((t, spec.dtype) for t, _, spec in riders),
                outputs=unit.outputs,
                companions=tuple((name, spec) for _, name, spec in riders),
            )
            seen.add(owner)
        attached.append(unit)
    orphans = sorted(
        name for owner, riders in scales.items() if owner not in seen for _, name, _ in riders
    )
    if orphans:
        raise ValueError(f"scales without an unsplit, unfused owner in the state: {orphans}")
    names: set[str] = set()
    for unit in attached:
        for name, _ in unit.info:
            if name in names:
                raise ValueError(f"name map sends two tensors to {name!r}")
            names.add(name)
    return tuple(attached)


def state_tensors(
    state: torch.nn.Module | Mapping[str, torch.Tensor],
) -> Mapping[str, torch.Tensor]:
    """The current tensors of a module (its ``state_dict()``) or the mapping itself."""
    import torch

    return state.state_dict() if isinstance(state, torch.nn.Module) else state


def state_plan(
    tensors: Mapping[str, torch.Tensor], name_map: NameMap, dtype: str | None
) -> tuple[Unit, ...]:
    """The plan of ``tensors`` (shapes and dtypes only; a DTensor counts by its global shape)."""
    return build_plan(
        ((name, TensorSpec.of(tensor)) for name, tensor in tensors.items()), name_map, dtype
    )


def plan_info(units: Iterable[Unit]) -> StateDictInfo:
    """Checkpoint name -> spec of every tensor of ``units``, in iteration order."""
    return {name: spec for unit in units for name, spec in unit.info}


def pack_buckets(units: Sequence[Unit], bucket_size_bytes: int | None) -> list[tuple[Unit, ...]]:
    """Consecutive units grouped while their bytes fit ``bucket_size_bytes``; a larger unit
    travels alone; None puts every unit in a bucket of its own."""
    if bucket_size_bytes is None:
        return [(unit,) for unit in units]
    buckets: list[tuple[Unit, ...]] = []
    current: list[Unit] = []
    size = 0
    for unit in units:
        if current and size + unit.nbytes > bucket_size_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(unit)
        size += unit.nbytes
    if current:
        buckets.append(tuple(current))
    return buckets


def fingerprint(buckets: Sequence[tuple[Unit, ...]]) -> int:
    """A 56-bit fingerprint of a bucket plan (fits an int64 tensor; ranks compare it)."""
    digest = hashlib.blake2b(repr(buckets).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def materialize(unit: Unit, tensors: Sequence[torch.Tensor]) -> list[NamedTensor]:
    """The unit's checkpoint tensors from its inputs, already cast, in ``unit.inputs`` order.

    A split yields row views of its input, a fuse one new tensor; companions ride in the
    owner's ``metadata[SCALES_KEY]``.
    """
    import torch

    if len(tensors) != len(unit.inputs):
        raise ValueError(f"unit needs {len(unit.inputs)} tensors, got {len(tensors)}")
    main_count = len(unit.inputs) - len(unit.companions)
    main, riders = tensors[:main_count], tensors[main_count:]
    if unit.split_rows:
        pieces: Sequence[torch.Tensor] = torch.split(main[0], list(unit.split_rows))
    elif main_count > 1:
        pieces = [torch.cat(list(main))]
    else:
        pieces = [main[0]]
    metadata = _NO_METADATA
    if riders:
        scales = {name: t for (name, _), t in zip(unit.companions, riders, strict=True)}
        metadata = MappingProxyType({SCALES_KEY: MappingProxyType(scales)})
    return [
        NamedTensor(name, piece, metadata=metadata)
        for (name, _), piece in zip(unit.outputs, pieces, strict=True)
    ]
