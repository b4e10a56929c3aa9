"""One engine worker's LoRA adapters, version by version, held in host memory.

Each version of an adapter is a whole set of A/B tensors of its own, built from the payloads of
one refit: a dense resync writes every tensor, a delta is applied to a copy of the version it
was built against (the base stays as it was). A version is served under a LoRA id of its own
(:func:`~refit_zmq.lora.load.served_name`), so requests that started on a version keep it
while new requests get the next one, and a version is dropped only when nothing can ask for
it (:meth:`AdapterStore.retire`). No vLLM here: :mod:`refit_zmq.vllm.lora_worker` serves the
held versions to vLLM's LoRA manager.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_core import GeometryMismatchError, RefitError, StaleBaseError, WeightVersion
from refit_zmq.codec import apply_payload
from refit_zmq.lora.flat import views
from refit_zmq.lora.load import AdapterLoad, Specs, flat_buffers

__all__ = ["AdapterStore", "HeldVersion"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldVersion:
    """One version of an adapter a worker holds: its flat buffers (:func:`flat_layout`)."""

    adapter: str
    version: int
    lora_id: int
    config: Mapping[str, Any]
    specs: Specs
    flats: Mapping[str, torch.Tensor]

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under its name: views into the flat buffers."""
        return views(self.specs, self.flats)

    @property
    def nbytes(self) -> int:
        """Host memory its tensors take."""
        return sum(t.numel() * t.element_size() for t in self.flats.values())


class AdapterStore:
    """The adapter versions of one worker; which one each adapter serves."""

    def __init__(self) -> None:
        self._held: dict[str, dict[int, HeldVersion]] = {}
        self._serving: dict[str, int] = {}
        self._by_id: dict[int, HeldVersion] = {}
        self._began: dict[str, int] = {}

    def receive(self, load: AdapterLoad) -> HeldVersion:
        """Build ``load``'s version beside every version held, and hold it (not served yet).

        Raises:
            StaleBaseError: its base is not held here (the sender must resync).
            GeometryMismatchError: a payload names a tensor the specs do not give as it.
            ChecksumMismatchError, ProtocolError: a corrupted or malformed payload.
            RefitError: the version is not above the one served, or its LoRA id is taken.
            In every case nothing is held and every held version is as it was; a version
            that got past these two checks counts as begun (:meth:`status`).
        """
        held = self._held.get(load.adapter, {})
        serving = self._serving.get(load.adapter)
        if serving is not None and load.version <= serving:
            raise RefitError(
                f"adapter {load.adapter!r}: version {load.version} is not above the served "
                f"version {serving}"
            )
        if load.version in held or load.lora_id in self._by_id:
            raise RefitError(
                f"adapter {load.adapter!r}: version {load.version} or LoRA id {load.lora_id} "
                "is held already"
            )
        self._began[load.adapter] = max(load.version, self._began.get(load.adapter, 0))
        flats, current = self._start(load, held)
        written: set[str] = set()
        for payload in load.payloads:
            written.update(apply_payload(payload, flats, current).tensors)
        if load.base is None and written != set(flats):
            raise GeometryMismatchError(
                f"adapter {load.adapter!r}: the resync to version {load.version} did not carry "
                f"{sorted(set(flats) - written)}"
            )
        version = HeldVersion(
            load.adapter, load.version, load.lora_id, load.config, load.specs, flats
        )
        self._held.setdefault(load.adapter, {})[load.version] = version
        self._by_id[load.lora_id] = version
        logger.info(
            "adapter %s: version %d held (LoRA id %d, %d bytes, %s)",
            load.adapter,
            load.version,
            load.lora_id,
            version.nbytes,
            "resync" if load.base is None else f"delta from version {load.base}",
        )
        return version

    def _start(
        self, load: AdapterLoad, held: Mapping[int, HeldVersion]
    ) -> tuple[dict[str, torch.Tensor], WeightVersion | None]:
        """The new version's flat buffers before the payloads: zeros for a resync, else a copy
        of the base's."""
        if load.base is None:
            return {
                flat: torch.zeros(numel, dtype=_dtype(dtype))
                for flat, (numel, dtype) in flat_buffers(load.specs).items()
            }, None
        base = held.get(load.base)
        if base is None:
            raise StaleBaseError(
                f"adapter {load.adapter!r}: delta against version {load.base}, which this "
                f"worker does not hold (it holds {sorted(held)})"
            )
        if list(base.specs.items()) != list(load.specs.items()):
            raise GeometryMismatchError(
                f"adapter {load.adapter!r}: version {load.version} changes the tensors of "
                f"version {load.base}; a resync carries a new geometry"
            )
        return {n: t.clone() for n, t in base.flats.items()}, WeightVersion(load.base)

    def serve(self, adapter: str, version: int) -> int | None:
        """``version`` is the one new requests get; the version served before (None: none).

        Raises:
            RefitError: ``version`` is not held.
        """
        self.find(adapter, version)
        previous = self._serving.get(adapter)
        self._serving[adapter] = version
        logger.info("adapter %s: serving version %d", adapter, version)
        return previous

    def drop(self, adapter: str, version: int) -> HeldVersion | None:
        """Forget ``version`` (a failed refit's, or one retired); never the one served."""
        if self._serving.get(adapter) == version:
            raise RefitError(f"adapter {adapter!r}: version {version} is served; not dropped")
        dropped = self._held.get(adapter, {}).pop(version, None)
        if dropped is not None:
            del self._by_id[dropped.lora_id]
            logger.info("adapter %s: version %d dropped", adapter, version)
        return dropped

    def retire(self, adapter: str, keep: set[int]) -> list[HeldVersion]:
        """Drop every version of ``adapter`` but the one served and ``keep``."""
        return [
            dropped
            for version in sorted(self._held.get(adapter, {}))
            if version not in keep
            and version != self._serving.get(adapter)
            and (dropped := self.drop(adapter, version)) is not None
        ]

    def find(self, adapter: str, version: int) -> HeldVersion:
        """A held version.

        Raises:
            RefitError: not held.
        """
        found = self._held.get(adapter, {}).get(version)
        if found is None:
            raise RefitError(f"adapter {adapter!r}: version {version} is not held here")
        return found

    def by_id(self, lora_id: int) -> HeldVersion | None:
        """The version served under ``lora_id``, if held."""
        return self._by_id.get(lora_id)

    def status(self, adapter: str) -> dict[str, Any]:
        """What this worker holds of ``adapter``: ``serving`` (its version, None: none),
        ``lora_id`` (the served version's), ``held`` (versions), ``began`` (the highest
        version it ever began to build, held or not; None: none), ``max_lora_id`` (of any
        adapter held, 0: none)."""
        serving = self._serving.get(adapter)
        return {
            "serving": serving,
            "lora_id": None if serving is None else self.find(adapter, serving).lora_id,
            "held": sorted(self._held.get(adapter, {})),
            "began": self._began.get(adapter),
            "max_lora_id": max(self._by_id, default=0),
        }


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise GeometryMismatchError(f"unknown dtype {name!r}")
    return dtype
