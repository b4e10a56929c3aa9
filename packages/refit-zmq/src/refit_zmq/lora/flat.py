"""An adapter's tensors as flat buffers and back (:func:`~refit_zmq.lora.load.flat_layout`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from refit_core import GeometryMismatchError, NamedTensor
from refit_zmq.lora.load import Specs, flat_layout

__all__ = ["flatten", "views"]


def flatten(specs: Specs, tensors: Iterable[NamedTensor]) -> dict[str, torch.Tensor]:
    """The flat buffers (on the host) of ``tensors``, which must be exactly those of ``specs``.

    Raises:
        GeometryMismatchError: a tensor missing, extra, or of another shape or dtype.
    """
    given = {named.name: named.tensor for named in tensors}
    if set(given) != set(specs):
        raise GeometryMismatchError(
            f"the source yielded {sorted(set(given) ^ set(specs))[:3]} beside or instead of "
            "what it described"
        )
    for name, (shape, dtype) in specs.items():
        tensor = given[name]
        if tuple(tensor.shape) != shape or str(tensor.dtype) != f"torch.{dtype}":
            raise GeometryMismatchError(
                f"{name} is {tensor.dtype} {tuple(tensor.shape)}, described as {dtype} {shape}"
            )
    return {
        flat: torch.cat([given[slot.name].detach().reshape(-1).cpu() for slot in slots])
        for flat, slots in flat_layout(specs).items()
    }


def views(specs: Specs, flats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of ``specs`` under its name: views into ``flats``."""
    return {
        slot.name: flats[flat][slot.start : slot.start + slot.numel].view(slot.shape)
        for flat, slots in flat_layout(specs).items()
        for slot in slots
    }
