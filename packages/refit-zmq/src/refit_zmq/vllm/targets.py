"""Where a vLLM worker's checkpoint tensors live, and how a delta reaches them.

A checkpoint tensor is written **in place**: its elements go straight into the runtime
parameters vLLM's loader copies them to (the :class:`~refit_core.vllm.write_map.WriteMap`,
verified at start), scattered with undo; or it lives in the **shadow**: a checkpoint-format
host copy that is loaded into the model through vLLM's layerwise reload, a whole module at a
time. The shadow holds exactly the tensors of modules whose runtime parameters are not plain
copies of the checkpoint: repacked (vLLM's CPU backend turns linear weights into oneDNN or
packed handles, quantized kernels repack theirs), or written by anything the map cannot replay.
On a GPU with unquantized weights the shadow is empty.

A delta is first **staged** (:meth:`CheckpointTargets.stage`: decoded, this rank's part of it
kept with the positions it goes to), then **applied** (:meth:`CheckpointTargets.apply`):
written with an undo log, so a failure while writing restores every bit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from refit_core import RefitError
from refit_core.vllm.write_map import Piece, WriteMap
from refit_zmq.codec import ItemHeader, UndoEntry, UndoLog
from refit_zmq.codec.dtypes import int_dtype, int_view
from refit_zmq.codec.scatter import gather, read_range, scatter, write_range

__all__ = ["CheckpointTargets", "StagedWrite", "plan_targets"]

logger = logging.getLogger(__name__)


_INT32_POSITIONS = 2**31 - 1
"""Targets up to this many elements keep their positions as int32 until applied."""


@dataclass(frozen=True)
class StagedWrite:
    """Bits to write into ``target`` (a flat integer view): at ``positions``, or, when those
    are None, a run from ``start``; ``name`` is the checkpoint tensor they belong to."""

    name: str
    target: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | None = None
    start: int = 0

    @classmethod
    def scattered(
        cls, name: str, target: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> StagedWrite:
        """A write at ``positions``, held as int32 where ``target`` is small enough (half the
        memory of int64 while the write waits for its commit)."""
        narrow = target.numel() <= _INT32_POSITIONS
        return cls(name, target, values, positions.to(torch.int32 if narrow else torch.int64))

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        held = self.values.numel() * self.values.element_size()
        positions = self.positions
        return held + (0 if positions is None else positions.numel() * positions.element_size())


def _repacked(module: torch.nn.Module) -> str | None:
    """Why ``module``'s kernels do not read its runtime parameters as loaded (None: they do)."""
    if getattr(module, "cpu_linear", None) is not None:
        return "vLLM's CPU backend repacked it"
    method = getattr(module, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        return f"{type(method).__name__} repacks it"
    return None


@dataclass(frozen=True)
class TargetPlan:
    """Which checkpoint tensors are written in place and which live in the shadow.

    Attributes:
        pieces: in-place checkpoint name -> its copies into runtime parameters.
        groups: shadowed checkpoint name -> every shadowed name vLLM must reload with it (the
            tensors of every module it is loaded into, and of every module those feed, and
            so on: a module is processed only once all of its tensors arrived).
        reasons: module -> why it is reloaded from the shadow instead.
    """

    pieces: Mapping[str, list[Piece]]
    groups: Mapping[str, frozenset[str]]
    reasons: Mapping[str, str]

    @property
    def shadowed(self) -> frozenset[str]:
        """The checkpoint names kept in the shadow."""
        return frozenset(self.groups)

    def reload_set(self, names: Iterable[str]) -> set[str]:
        """The shadowed names to reload so that every module reading one of ``names`` is
        complete."""
        return set().union(*(self.groups[n] for n in names if n in self.groups))


def plan_targets(
    model: torch.nn.Module,
    found: WriteMap,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    checkpoint: Callable[[], Iterable[tuple[str, torch.Tensor]]],
) -> TargetPlan:
    """Place every checkpoint tensor of ``specs``: in place where ``found`` (``model``'s write
    map) reaches a plain parameter whose round trip against ``checkpoint()`` (the tensors the
    model was loaded from) holds; the modules that cannot be written so, and every checkpoint
    tensor they read, go to the shadow (all of them, without a write map)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    by_param = found.params()
    not_in_place = found.not_in_place()
    reasons: dict[str, str] = {}
    for param, written in by_param.items():
        module_name = param.rpartition(".")[0]
        live = params.get(param)
        expected = written[0].param_shape
        reason = (
            _repacked(model.get_submodule(module_name))
            or not_in_place.get(param)
            or found.uncovered(param, expected)
            or _layout_mismatch(live, expected)
        )
        if reason is not None:
            reasons.setdefault(module_name, f"{param}: {reason}")
    for param, reason in not_in_place.items():
        reasons.setdefault(param.rpartition(".")[0], f"{param}: {reason}")
    for param in params.keys() - by_param.keys() - found.fills.keys():
        reasons.setdefault(param.rpartition(".")[0], f"{param}: the loader never wrote it")
    candidates = {
        p: t for p, t in params.items() if p in by_param and p.rpartition(".")[0] not in reasons
    }
    for param, reason in found.verify(checkpoint(), candidates).items():
        reasons.setdefault(param.rpartition(".")[0], f"{param}: {reason}")
    names_of: dict[str, set[str]] = {}
    modules_of: dict[str, set[str]] = {}
    for param, names in found.written_by.items():
        module_name = param.rpartition(".")[0]
        names_of.setdefault(module_name, set()).update(names)
        for name in names:
            modules_of.setdefault(name, set()).add(module_name)
    if found.pieces:
        groups: dict[str, frozenset[str]] = {}
        for name in _close_over(set(reasons), names_of, modules_of):
            if name not in groups:
                group = frozenset(_close_over(modules_of[name], names_of, modules_of))
                groups.update(dict.fromkeys(group, group))
        # a tensor the map never saw written is reloaded through vLLM's own loader, alone
        groups.update({name: frozenset({name}) for name in specs if name not in modules_of})
    else:
        groups = _layer_groups(specs)
    for module_name, reason in sorted(reasons.items()):
        logger.info("shadow: %s (%s)", module_name, reason)
    in_place = {n: found.pieces.get(n, []) for n in specs if n not in groups}
    return TargetPlan(in_place, groups, reasons)


def _layer_groups(names: Iterable[str]) -> dict[str, frozenset[str]]:
    """Without a write map: every tensor in the shadow, reloaded with its decoder layer (or
    its parent module)."""
    layers: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")
        digits = [i for i, part in enumerate(parts) if part.isdigit()]
        layer = ".".join(parts[: digits[0] + 1]) if digits else name.rpartition(".")[0]
        layers.setdefault(layer, set()).add(name)
    return {name: frozenset(group) for group in layers.values() for name in group}


def _layout_mismatch(live: torch.Tensor | None, shape: tuple[int, ...]) -> str | None:
    if live is None:
        return "not a parameter of the running model"
    if tuple(live.shape) != shape or not live.is_contiguous():
        return f"runtime layout {tuple(live.shape)} differs from the loaded {shape}"
    return None


def _close_over(
    modules: set[str], names_of: Mapping[str, set[str]], modules_of: Mapping[str, set[str]]
) -> set[str]:
    """Every checkpoint tensor the reloaded ``modules`` read, and every module such a tensor
    feeds, until nothing changes (vLLM reloads a module whole, from all of its tensors)."""
    modules = set(modules)
    names: set[str] = set()
    while True:
        names = set().union(names, *(names_of.get(m, set()) for m in modules))
        grown = set().union(*(modules_of[n] for n in names))
        if grown <= modules:
            return names
        modules |= grown


class CheckpointTargets:
    """The in-place parameters and the shadow of one worker (see the module docstring).

    Args:
        model: the worker's model.
        plan: what goes where (:func:`plan_targets`).
        shadow: the shadowed checkpoint tensors (copies the targets own).
    """

    def __init__(
        self, model: torch.nn.Module, plan: TargetPlan, shadow: Mapping[str, torch.Tensor]
    ) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        self.plan = plan
        self.shadow = dict(shadow)
        self._params = {
            p.param: params[p.param].detach().view(-1)
            for pieces in plan.pieces.values()
            for p in pieces
        }
        self._flats = {name: int_view(flat) for name, flat in self._params.items()}
        self._shadow_flats = {n: int_view(t).view(-1) for n, t in self.shadow.items()}

    @property
    def in_place_bytes(self) -> int:
        """Runtime bytes a delta writes in place."""
        return sum(f.numel() * f.element_size() for f in self._flats.values())

    @property
    def shadow_bytes(self) -> int:
        """Host bytes the shadow holds."""
        return sum(f.numel() * f.element_size() for f in self._shadow_flats.values())

    def stage(
        self, item: ItemHeader, indices: np.ndarray | None, values: np.ndarray
    ) -> list[StagedWrite]:
        """This worker's writes of one decoded item: ``indices`` are its tensor's row-major
        element indices (None: a run of ``values`` from the item's first element)."""
        bits = torch.from_numpy(np.require(values, requirements="W")).view(int_dtype(item.dtype))
        start = item.span_start + item.first
        shadow = self._shadow_flats.get(item.name)
        if shadow is not None:
            if indices is None:
                return [StagedWrite(item.name, shadow, bits, start=start)]
            return [StagedWrite.scattered(item.name, shadow, bits, torch.from_numpy(indices))]
        writes = []
        for piece in self.plan.pieces.get(item.name, []):
            target = self._flats[piece.param]
            run = piece.flat_range()
            if indices is None and run is not None:
                lo, hi = max(start, run[0]), min(start + bits.numel(), run[0] + piece.numel)
                if lo < hi:
                    chunk = bits[lo - start : hi - start]
                    writes.append(StagedWrite(item.name, target, chunk, start=run[1] + lo - run[0]))
                continue
            flat = (
                torch.arange(start, start + bits.numel())
                if indices is None
                else torch.from_numpy(indices)
            )
            inside, positions = piece.select(flat)
            if positions.numel():
                writes.append(StagedWrite.scattered(item.name, target, bits[inside], positions))
        return writes

    def apply(self, writes: Iterable[StagedWrite]) -> UndoLog:
        """Write ``writes`` in order, keeping the bits they replace; a failure restores them
        and raises."""
        undo = UndoLog()
        try:
            for write in writes:
                target = write.target
                values = write.values.to(target.device, non_blocking=True)
                if write.positions is None:
                    undo.add(
                        UndoEntry(
                            target,
                            read_range(target, write.start, values.numel()),
                            start=write.start,
                        )
                    )
                    write_range(target, write.start, values)
                else:
                    positions = write.positions.to(target.device, torch.int64, non_blocking=True)
                    undo.add(UndoEntry(target, gather(target, positions), positions))
                    scatter(target, positions, values)
        except BaseException:
            undo.restore()
            raise
        return undo

    def reload_items(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        """The shadowed tensors vLLM must reload so that every module reading one of
        ``names`` is complete (a module is processed once all of its tensors arrived)."""
        wanted = self.plan.reload_set(names)
        return [(n, t) for n, t in self.shadow.items() if n in wanted]

    def checkpoint_tensor(self, name: str) -> torch.Tensor:
        """Checkpoint tensor ``name`` as the model holds it now, read back from the runtime
        parameters (in place) or the shadow.

        Raises:
            RefitError: this worker holds only part of it (a tensor-parallel slice).
        """
        if name in self.shadow:
            return self.shadow[name]
        pieces = self.plan.pieces.get(name, [])
        if not pieces:
            raise RefitError(f"{name}: the model does not use it")
        out = torch.empty(pieces[0].shape, dtype=self._params[pieces[0].param].dtype)
        covered = torch.zeros(pieces[0].shape, dtype=torch.bool)
        for piece in pieces:
            piece.source_view(out).copy_(piece.target_view(self._params[piece.param]).cpu())
            piece.source_view(covered).fill_(True)
        if not bool(covered.all()):
            raise RefitError(
                f"{name}: this worker holds {int(covered.sum())} of {math.prod(out.shape)} elements"
            )
        return out
