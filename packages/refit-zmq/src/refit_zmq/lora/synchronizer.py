"""The ``lora`` row's synchronizer: one adapter's tensors from the trainer's memory into every
engine, as a new version served beside the old ones.

Each refit reads the adapter from ``policy.weight_source()`` (PEFT names:
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), encodes it with the sparse
codec against the version every engine holds (a delta: only changed elements, where that is
smaller; the first refit, a changed geometry, or an engine missing the base: a dense resync),
has every worker of every engine build and hold the new version (checked as vLLM will use
it), and only then makes it the version new requests get. A failure anywhere before that
drops the new version everywhere: every engine serves the previous version, and requests in
flight never notice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from refit_core import (
    EngineHealth,
    EngineStatus,
    FleetStatus,
    GeometryMismatchError,
    RefitResult,
    StateDictInfo,
    TensorSpec,
    WeightSynchronizer,
    WeightVersion,
    WorkerOutcome,
)
from refit_core.backend import Deadline, PolicyLike
from refit_zmq.lora.flat import flatten
from refit_zmq.lora.load import AdapterLoad, flat_buffers
from refit_zmq.lora.options import LoraOptions
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

__all__ = ["AdapterEngine", "LoraGeneration", "LoraWeightSynchronizer"]

logger = logging.getLogger(__name__)


@runtime_checkable
class AdapterEngine(Protocol):
    """One engine's report on one adapter (``refit_zmq.vllm.AdapterOnEngine``)."""

    shard: int
    label: str
    serving: int | None
    held: frozenset[int]
    began: int | None
    lora_id: int | None
    max_lora_id: int
    error: str | None


@runtime_checkable
class LoraGeneration(Protocol):
    """Engines that hold adapter versions from memory
    (:class:`~refit_zmq.vllm.VllmLoraGeneration`)."""

    def adapter_status(self, adapter: str, timeout_s: float | None) -> Sequence[AdapterEngine]:
        """The adapter on every engine."""
        ...

    def adopt(self, adapter: str, engines: Sequence[AdapterEngine]) -> None:
        """Take over what the engines serve (a new controller)."""
        ...

    def new_lora_id(self) -> int:
        """A LoRA id unused on every engine."""
        ...

    def load_adapter(self, load: AdapterLoad, timeout_s: float | None) -> dict[str, float]:
        """Hold ``load`` on every engine, or on none (raises ``RefitError``); the engines'
        seconds per step."""
        ...

    def serve_adapter(self, load: AdapterLoad, timeout_s: float | None) -> dict[str, str]:
        """Serve ``load``'s version to new requests; engines that did not confirm."""
        ...


class LoraWeightSynchronizer(WeightSynchronizer):
    """Moves one LoRA adapter (``options.adapter``) into every engine of ``generation``.

    Args:
        policy: the trainer: ``weight_source()`` yields the adapter's A/B tensors.
        generation: the engines.
        options: the adapter's name and configuration.
        refit_timeout_s: deadline of one refit (None: each engine call is bounded by
            ``options.rpc_timeout_s``).
    """

    def __init__(
        self,
        policy: PolicyLike,
        generation: LoraGeneration,
        options: LoraOptions,
        *,
        refit_timeout_s: float | None = None,
    ) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        self._policy = policy
        self._generation = generation
        self.options = options
        self._tracker: DeltaCompressionTracker | None = None
        self._specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self._deltas = _DeltaPolicy()

    def _timeout(self, deadline: Deadline) -> float:
        remaining = deadline.remaining_s()
        return self.options.rpc_timeout_s if remaining is None else max(remaining, 0.001)

    def _init_communicator(self, deadline: Deadline) -> None:
        engines = self._generation.adapter_status(self.options.adapter, self._timeout(deadline))
        self._generation.adopt(self.options.adapter, engines)

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        """The adapter on every engine: the version new requests get there (``closed``: the
        engine serves no version of it)."""
        engines = self._generation.adapter_status(self.options.adapter, self._timeout(deadline))
        return FleetStatus.of(_engine_status(self.options.adapter, e) for e in engines)

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        started = time.monotonic()
        timings: dict[str, float] = {}

        def lap(step: str) -> None:
            timings[step] = time.monotonic() - started - sum(timings.values())

        adapter = self.options.adapter
        source = self._policy.weight_source()
        tracker = self._tracker_for(source.state_dict_info())
        engines = self._generation.adapter_status(adapter, self._timeout(deadline))
        base = tracker.version
        if (
            base is None
            or not all(base.value in e.held for e in engines)
            or not self._deltas.worth_comparing()
        ):
            base = None
        lap("status")
        flats = flatten(self._specs, source.iter_tensors())
        payloads = list(tracker.encode(flats, WeightVersion(version), resync=base is None))
        load = AdapterLoad(
            adapter=adapter,
            version=version,
            lora_id=self._generation.new_lora_id(),
            base=None if base is None else base.value,
            specs=self._specs,
            config=self.options.peft_config(),
            payloads=[payload.to_bytes() for payload in payloads],
        )
        lap("encode")
        try:
            engine_steps = self._generation.load_adapter(load, self._timeout(deadline))
        except BaseException:
            tracker.abort()
            raise
        tracker.commit()
        self._deltas.sent(
            compared=base is not None,
            changed=sum(p.changed_elements for p in payloads),
            elements=sum(numel for numel, _ in flat_buffers(self._specs).values()),
        )
        lap("load")
        lagging = self._generation.serve_adapter(load, self._timeout(deadline))
        lap("serve")
        return RefitResult(
            version=version,
            timings_s={**timings, **engine_steps},
            total_s=time.monotonic() - started,
            wire_bytes=sum(len(p) for p in load.payloads),
            dense_bytes=_nbytes(self._specs),
            workers=tuple(
                WorkerOutcome(e.label, e.label not in lagging, version, lagging.get(e.label))
                for e in engines
            ),
            changed_elements=sum(p.changed_elements for p in payloads),
        )

    def _tracker_for(self, info: StateDictInfo) -> DeltaCompressionTracker:
        """The tracker of the adapter's geometry (a new one, so a dense resync, when the
        geometry changed)."""
        specs = {name: (tuple(spec.shape), spec.dtype) for name, spec in info.items()}
        _check_rank(self.options, specs)
        if self._tracker is None or specs != self._specs:
            if self._tracker is not None:
                logger.info(
                    "adapter %s: new geometry; the next refit is a resync", self.options.adapter
                )
                self._tracker.close()
            flats = {
                flat: TensorSpec((numel,), dtype)
                for flat, (numel, dtype) in flat_buffers(specs).items()
            }
            self._tracker = DeltaCompressionTracker(
                flats, TrackerConfig(threads=1, compress=self.options.compress)
            )
            self._specs = specs
        return self._tracker

    def _shutdown(self) -> None:
        if self._tracker is not None:
            self._tracker.close()


class _DeltaPolicy:
    """Whether the next refit compares with the last version (a delta) or sends the adapter
    whole (a resync, which costs no comparison). A step that changed most elements (an AdamW
    step on a float32 adapter changes every one) makes a delta no smaller than the adapter,
    so while the last comparison found that, refits are resyncs, comparing again every
    :attr:`RECHECK` refits in case the steps became sparse."""

    PAYS_BELOW = 0.5
    """A delta pays while it carries less than this fraction of the elements."""
    RECHECK = 8

    def __init__(self) -> None:
        self._changed_fraction = 0.0
        self._since_compared = 0

    def worth_comparing(self) -> bool:
        return self._changed_fraction < self.PAYS_BELOW or self._since_compared + 1 >= self.RECHECK

    def sent(self, *, compared: bool, changed: int, elements: int) -> None:
        if compared:
            self._changed_fraction = changed / max(elements, 1)
            self._since_compared = 0
        else:
            self._since_compared += 1


def _check_rank(options: LoraOptions, specs: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Every ``lora_A`` has ``rank`` rows and every ``lora_B`` ``rank`` columns."""
    if not specs:
        raise GeometryMismatchError(f"adapter {options.adapter!r}: the source yields no tensor")
    for name, (shape, _) in specs.items():
        rank = shape[0] if ".lora_A." in name else shape[-1] if ".lora_B." in name else None
        if rank is None or len(shape) != 2:
            raise GeometryMismatchError(
                f"adapter {options.adapter!r}: {name} {shape} is no 2-D lora_A / lora_B tensor"
            )
        if rank != options.rank:
            raise GeometryMismatchError(
                f"adapter {options.adapter!r}: {name} {shape} has rank {rank}, options say "
                f"{options.rank}"
            )


def _nbytes(specs: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Bytes of the whole adapter."""
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in specs.values())


def _engine_status(adapter: str, engine: AdapterEngine) -> EngineStatus:
    if engine.error is not None:
        return EngineStatus(
            engine.shard, engine.label, EngineHealth.UNREACHABLE, detail=engine.error
        )
    if engine.serving is None:
        return EngineStatus(
            engine.shard,
            engine.label,
            EngineHealth.CLOSED,
            detail=f"serves no version of adapter {adapter!r} (or its workers disagree)",
            began_version=engine.began,
        )
    return EngineStatus(
        engine.shard,
        engine.label,
        EngineHealth.SERVING,
        engine.serving,
        began_version=engine.began,
    )
