"""The calls the controller makes into a refit-zmq vLLM worker, as typed call objects.

Each call is a frozen dataclass whose ``run`` calls :class:`ZmqWorkerRole` (what the worker
extension does for the controller) by its typed method; the worker runs whatever it is sent
through one dispatcher (:func:`refit_core.backend.answer`), and calls and replies travel as
pickled bytes (:mod:`refit_core.worker_calls` says why). The controller sends them with
:func:`refit_zmq.vllm.engines.call_workers`, which returns each worker's typed result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from refit_core.backend import WorkerCall

__all__ = [
    "Address",
    "CheckpointDigests",
    "FinishUpdate",
    "InitReceiver",
    "LoraDrop",
    "LoraLoad",
    "LoraServe",
    "LoraStatus",
    "Partial",
    "Placement",
    "StartUpdate",
    "UpdateWeights",
    "Versions",
    "ZmqCall",
    "ZmqWorkerRole",
]

_R = TypeVar("_R", covariant=True)


class ZmqWorkerRole(Protocol):
    """What a vLLM worker with refit-zmq's extension does for the controller: vLLM's
    update-session steps, its receiver's state, and the LoRA row's adapters from memory."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Start the worker's receiver (vLLM's own step)."""
        ...

    def start_weight_update(self) -> None:
        """Open vLLM's update session."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Serve a refit (or load one, as ``update_info`` says) inside the session."""
        ...

    def finish_weight_update(self) -> None:
        """Close vLLM's update session."""
        ...

    def address(self) -> str:
        """Where the worker's receiver listens (receivers bind ephemeral ports)."""
        ...

    def partial(self) -> bool:
        """Whether the worker's model holds weights other than the version it serves."""
        ...

    def versions(self) -> tuple[int, int]:
        """The IPC receiver's committed version and the highest one a refit began."""
        ...

    def placement(self) -> dict[str, Any]:
        """Where the sparse receiver keeps each checkpoint tensor."""
        ...

    def checkpoint_digests(self) -> dict[str, int]:
        """The sparse receiver's read-back digest of every checkpoint tensor."""
        ...

    def lora_load(self, message: Mapping[str, Any]) -> dict[str, float]:
        """Hold and register a new adapter version; seconds per step."""
        ...

    def lora_serve(self, adapter: str, version: int, keep: list[int] | None) -> None:
        """New requests get ``version``; versions neither served nor kept go."""
        ...

    def lora_drop(self, adapter: str, version: int) -> None:
        """Forget a version that never served."""
        ...

    def lora_status(self, adapter: str) -> dict[str, Any]:
        """What the worker holds of ``adapter``."""
        ...


class ZmqCall(WorkerCall[ZmqWorkerRole, _R]):
    """A call into a refit-zmq vLLM worker (errors name it by its class)."""


@dataclass(frozen=True)
class InitReceiver(ZmqCall[None]):
    """Start the receiver (vLLM's ``init_weight_transfer_engine``)."""

    init_info: dict[str, Any]

    def run(self, target: ZmqWorkerRole) -> None:
        target.init_weight_transfer_engine(self.init_info)


@dataclass(frozen=True)
class StartUpdate(ZmqCall[None]):
    """Open vLLM's update session."""

    def run(self, target: ZmqWorkerRole) -> None:
        target.start_weight_update()


@dataclass(frozen=True)
class UpdateWeights(ZmqCall[None]):
    """vLLM's ``update_weights`` with the receiver's ``update_info``."""

    update_info: dict[str, Any]

    def run(self, target: ZmqWorkerRole) -> None:
        target.update_weights(self.update_info)


@dataclass(frozen=True)
class FinishUpdate(ZmqCall[None]):
    """Close vLLM's update session."""

    def run(self, target: ZmqWorkerRole) -> None:
        target.finish_weight_update()


@dataclass(frozen=True)
class Address(ZmqCall[str]):
    """Where the receiver listens."""

    def run(self, target: ZmqWorkerRole) -> str:
        return target.address()


@dataclass(frozen=True)
class Partial(ZmqCall[bool]):
    """Whether the model holds weights other than the version it serves."""

    def run(self, target: ZmqWorkerRole) -> bool:
        return target.partial()


@dataclass(frozen=True)
class Versions(ZmqCall[tuple[int, int]]):
    """The IPC receiver's committed version and the highest one a refit began."""

    def run(self, target: ZmqWorkerRole) -> tuple[int, int]:
        return target.versions()


@dataclass(frozen=True)
class Placement(ZmqCall[dict[str, Any]]):
    """Where the sparse receiver keeps each checkpoint tensor."""

    def run(self, target: ZmqWorkerRole) -> dict[str, Any]:
        return target.placement()


@dataclass(frozen=True)
class CheckpointDigests(ZmqCall[dict[str, int]]):
    """The sparse receiver's read-back digests."""

    def run(self, target: ZmqWorkerRole) -> dict[str, int]:
        return target.checkpoint_digests()


@dataclass(frozen=True)
class LoraLoad(ZmqCall[dict[str, float]]):
    """Hold and register an adapter version carried by ``message``."""

    message: Mapping[str, Any]

    def run(self, target: ZmqWorkerRole) -> dict[str, float]:
        return target.lora_load(self.message)


@dataclass(frozen=True)
class LoraServe(ZmqCall[None]):
    """Serve ``version`` of ``adapter``, keeping ``keep`` (None: every version)."""

    adapter: str
    version: int
    keep: list[int] | None

    def run(self, target: ZmqWorkerRole) -> None:
        target.lora_serve(self.adapter, self.version, self.keep)


@dataclass(frozen=True)
class LoraDrop(ZmqCall[None]):
    """Forget ``version`` of ``adapter`` (it never served)."""

    adapter: str
    version: int

    def run(self, target: ZmqWorkerRole) -> None:
        target.lora_drop(self.adapter, self.version)


@dataclass(frozen=True)
class LoraStatus(ZmqCall[dict[str, Any]]):
    """What the worker holds of ``adapter``."""

    adapter: str

    def run(self, target: ZmqWorkerRole) -> dict[str, Any]:
        return target.lora_status(self.adapter)
