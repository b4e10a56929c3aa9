"""One adapter version as a refit carries it to every engine worker, and the names vLLM
serves it under. Plain Python: the controller's modules import it without torch.

An adapter is a hundred-odd small tensors; the codec's cost is per item, so a refit carries
it as one flat buffer per dtype (:func:`flat_layout`: its tensors one after the other, in the
order of ``specs``), and each side views its tensors in those buffers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refit_core import RefitError

__all__ = [
    "SCHEME",
    "AdapterLoad",
    "Slot",
    "adapter_path",
    "flat_buffers",
    "flat_layout",
    "served_name",
]

SCHEME = "refit-lora://"
"""The ``lora_path`` prefix of every adapter version refit serves from memory."""


def served_name(adapter: str, version: int) -> str:
    """The ``lora_name`` of ``version`` of ``adapter`` (vLLM tells adapters apart by name)."""
    return f"{adapter}@v{version}"


def adapter_path(adapter: str, version: int) -> str:
    """The ``lora_path`` of ``version`` of ``adapter``: no file, a key into the workers' store."""
    return f"{SCHEME}{adapter}/v{version}"


Specs = Mapping[str, tuple[tuple[int, ...], str]]
"""Tensor name -> (shape, dtype name), in the adapter's order."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in its dtype's flat buffer."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int


def flat_layout(specs: Specs) -> dict[str, list[Slot]]:
    """Flat buffer name (``flat.<dtype>``) -> its tensors, in order."""
    layout: dict[str, list[Slot]] = {}
    for name, (shape, dtype) in specs.items():
        slots = layout.setdefault(f"flat.{dtype}", [])
        start = slots[-1].start + slots[-1].numel if slots else 0
        slots.append(Slot(name, tuple(shape), start, math.prod(shape)))
    return layout


def flat_buffers(specs: Specs) -> dict[str, tuple[int, str]]:
    """Flat buffer name -> its length in elements and its dtype name."""
    return {
        flat: (slots[-1].start + slots[-1].numel, flat.removeprefix("flat."))
        for flat, slots in flat_layout(specs).items()
    }


@dataclass(frozen=True)
class AdapterLoad:
    """One version of one adapter, as a refit carries it to every worker.

    Attributes:
        adapter: the adapter's name.
        version: the version it becomes.
        lora_id: the LoRA id it is served under (unique per engine).
        base: the version the payloads are deltas against (None: a dense resync).
        specs: every tensor's shape and dtype name, in the order of :func:`flat_layout`.
        config: its PEFT configuration (``adapter_config.json``'s fields).
        payloads: the refit-zmq codec payloads of the flat buffers, each as one buffer
            (:mod:`~refit_zmq.lora.carrier` carries them).
    """

    adapter: str
    version: int
    lora_id: int
    base: int | None
    specs: Specs
    config: Mapping[str, Any]
    payloads: Sequence[Any]

    def to_message(self, payloads: Mapping[str, Any]) -> dict[str, Any]:
        """Plain values only (what an engine RPC carries intact), the payloads as
        :func:`~refit_zmq.lora.carrier.carried` gives them."""
        return {
            "adapter": self.adapter,
            "version": self.version,
            "lora_id": self.lora_id,
            "base": self.base,
            "specs": {name: [list(shape), dtype] for name, (shape, dtype) in self.specs.items()},
            "config": dict(self.config),
            "payloads": dict(payloads),
        }

    @classmethod
    def from_message(cls, message: Mapping[str, Any], payloads: Sequence[Any]) -> AdapterLoad:
        """The load :meth:`to_message` wrote, with its payloads as received."""
        try:
            return cls(
                adapter=str(message["adapter"]),
                version=int(message["version"]),
                lora_id=int(message["lora_id"]),
                base=None if message["base"] is None else int(message["base"]),
                specs={
                    str(name): (tuple(int(d) for d in shape), str(dtype))
                    for name, (shape, dtype) in message["specs"].items()
                },
                config=dict(message["config"]),
                payloads=list(payloads),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RefitError(f"malformed adapter load: {type(exc).__name__}: {exc}") from exc
