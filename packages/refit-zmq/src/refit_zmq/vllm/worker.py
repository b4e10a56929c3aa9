"""The worker extension that carries refit-zmq's calls into a vLLM worker.

Every call goes through one worker method, ``refit_zmq_call(request)``: the request is one of
the typed calls of :mod:`refit_zmq.vllm.calls`, run on the worker as a
:class:`~refit_zmq.vllm.calls.ZmqWorkerRole`, and the answer an encoded reply that never
raises (:mod:`refit_core.worker_calls`). The calls: vLLM's update-session steps, where the
worker's receiver listens (receivers bind ephemeral ports), whether its model holds weights
other than the version it serves, where the sparse receiver keeps each checkpoint tensor and
its read-back digests; and the LoRA row's adapters from memory
(:mod:`refit_zmq.vllm.lora_worker`). Start the engine with
``worker_extension_cls=WORKER_EXTENSION``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from refit_core import RefitError
from refit_core.backend import answer, encode
from refit_zmq.vllm.calls import ZmqCall

if TYPE_CHECKING:
    from refit_zmq.vllm.lora_worker import WorkerAdapters
    from refit_zmq.vllm.relay_engine import VllmRelayReceiver

__all__ = ["ZmqWorkerExtension"]

_T = TypeVar("_T")

_NO_RECEIVER = (
    "no refit-zmq receiver in this worker: start vLLM with refit_zmq.vllm.engine_args() "
    "and call init_weight_transfer_engine"
)
_NO_SPARSE_RECEIVER = "no refit-zmq sparse receiver in this worker"


class ZmqWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def refit_zmq_call(self, request: bytes) -> bytes:
        """Run the encoded call on this worker; the encoded reply (never raises)."""
        return encode(answer(request, ZmqCall, lambda: _WorkerRole(self)))


class _WorkerRole:
    """One vLLM worker as a :class:`~refit_zmq.vllm.calls.ZmqWorkerRole`."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._worker.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._worker.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._worker.update_weights(update_info)

    def finish_weight_update(self) -> None:
        self._worker.finish_weight_update()

    def address(self) -> str:
        return _attribute(self._receiver, "address", str, _NO_RECEIVER)

    def partial(self) -> bool:
        return _attribute(self._receiver, "partial", bool, _NO_RECEIVER)

    def versions(self) -> tuple[int, int]:
        return _attribute(self._receiver, "versions", tuple, _NO_RECEIVER)

    def placement(self) -> dict[str, Any]:
        result: dict[str, Any] = self._sparse_receiver.placement()
        return result

    def checkpoint_digests(self) -> dict[str, int]:
        result: dict[str, int] = self._sparse_receiver.checkpoint_digests()
        return result

    def lora_load(self, message: Mapping[str, Any]) -> dict[str, float]:
        return self._adapters.load(message)

    def lora_serve(self, adapter: str, version: int, keep: list[int] | None) -> None:
        self._adapters.serve(adapter, version, keep)

    def lora_drop(self, adapter: str, version: int) -> None:
        self._adapters.drop(adapter, version)

    def lora_status(self, adapter: str) -> dict[str, Any]:
        return self._adapters.store.status(adapter)

    @property
    def _receiver(self) -> Any:
        return self._worker.weight_transfer_engine

    @property
    def _sparse_receiver(self) -> VllmRelayReceiver:
        from refit_zmq.vllm.relay_engine import VllmRelayReceiver

        receiver = self._receiver
        if not isinstance(receiver, VllmRelayReceiver):
            raise RefitError(_NO_SPARSE_RECEIVER)
        return receiver

    @property
    def _adapters(self) -> WorkerAdapters:
        from refit_zmq.vllm.lora_worker import worker_adapters

        return worker_adapters(self._worker)


def _attribute(receiver: Any, name: str, kind: type[_T], missing: str) -> _T:
    value = getattr(receiver, name, None)
    if not isinstance(value, kind):
        raise RefitError(missing)
    return value
