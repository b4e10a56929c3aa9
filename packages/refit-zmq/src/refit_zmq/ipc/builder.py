"""The factory's builder of the (vllm, colocated, ``ipc``) row.

``policy`` is a ``PolicyLike`` in the trainer's process on the engines' host; ``generation``
lists the control addresses of its workers' :class:`~refit_zmq.ipc.IpcReceiver`
(:class:`IpcGeneration`), and opens their sessions around each refit where they need one
(:class:`~refit_zmq.ipc.synchronizer.RefitSessions`: vLLM engines). ``refit_buffer_size_gb``
(GiB) sizes each of the two buffers; ``options`` (:class:`~refit_zmq.ipc.IpcOptions`) sets the
rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from refit_core.backend import PolicyLike, SynchronizerRequest
from refit_zmq.ipc.synchronizer import IpcOptions, IpcWeightSynchronizer, RefitSessions

__all__ = ["IpcGeneration", "build_ipc_synchronizer"]


@runtime_checkable
class IpcGeneration(Protocol):
    """Engines whose workers each serve an :class:`~refit_zmq.ipc.IpcReceiver`."""

    def ipc_addresses(self) -> Sequence[str]:
        """The receivers' control addresses, one per engine worker, in shard order."""
        ...


def build_ipc_synchronizer(request: SynchronizerRequest) -> IpcWeightSynchronizer:
    """The factory's builder for (vllm, colocated, ipc).

    Raises:
        ValueError: a policy without ``weight_source()`` or a generation without
            ``ipc_addresses()``.
    """
    policy = request.policy
    generation = request.generation
    if not isinstance(policy, PolicyLike):
        raise ValueError("policy must provide weight_source()")
    if not isinstance(generation, IpcGeneration):
        raise ValueError("generation must provide ipc_addresses() (receivers in its workers)")
    return IpcWeightSynchronizer(
        policy,
        generation.ipc_addresses,
        refit_timeout_s=request.refit_timeout_s,
        options=request.with_buffer_size(
            request.options_as(IpcOptions) or IpcOptions(), "buffer_size_bytes"
        ),
        sessions=generation if isinstance(generation, RefitSessions) else None,
    )
