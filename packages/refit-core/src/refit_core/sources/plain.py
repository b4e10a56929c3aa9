"""The plain source: a local module or state dict whose tensors are whole on this process."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from refit_core.sources.cast import cast_once
from refit_core.sources.name_map import NameMap, Rename, as_name_map
from refit_core.sources.plan import materialize, plan_info, state_plan, state_tensors
from refit_core.types import NamedTensor, StateDictInfo

if TYPE_CHECKING:
    import torch

__all__ = ["StateDictSource"]


class StateDictSource:
    """A local ``torch.nn.Module`` or name -> tensor mapping, one tensor at a time.

    Args:
        state: a module (its ``state_dict()`` is read on every call, so the current weights
            are sent) or a mapping of tensors.
        dtype: the engine's dtype name (``"bfloat16"``); wide floating tensors are cast to
            it once (:mod:`refit_core.sources.cast`). None keeps each tensor's dtype.
        name_map: trainer name -> checkpoint name: a :class:`NameMap` or a rename callable.
    """

    def __init__(
        self,
        state: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        dtype: str | None = None,
        name_map: NameMap | Rename | None = None,
    ) -> None:
        self._state = state
        self._dtype = dtype
        self._name_map = as_name_map(name_map)

    def state_dict_info(self) -> StateDictInfo:
        """Checkpoint name -> spec of every tensor, after name mapping and casting."""
        return plan_info(state_plan(state_tensors(self._state), self._name_map, self._dtype))

    def iter_tensors(self) -> Iterator[NamedTensor]:
        """Yield each checkpoint tensor, mapped and cast, one unit at a time."""
        tensors = state_tensors(self._state)
        for unit in state_plan(tensors, self._name_map, self._dtype):
            yield from materialize(unit, [cast_once(tensors[n], d) for n, d in unit.inputs])
