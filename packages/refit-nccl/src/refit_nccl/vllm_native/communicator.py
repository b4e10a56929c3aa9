"""vLLM's own ``PyNcclCommunicator`` behind refit's communicator calls, with a real abort.

vLLM's NCCL weight-transfer receiver (``NCCLWeightTransferEngine``) joins only a communicator
built by vLLM's code: rank 0 publishes NCCL's unique id through vLLM's
``StatelessProcessGroup.broadcast_obj`` (store key ``broadcast_from/0/0``, no prefix), every
rank runs ``ncclCommInitRank`` and the one-element warm-up all-reduce. So the trainer builds it
with the same code, over the group's own TCPStore, and refit adds what vLLM leaves out:

* the init runs on a helper thread, bounded by the rendezvous deadline; ``abort()`` during it
  aborts the communicator as soon as NCCL has created it (which ends a warm-up a peer never
  joins);
* each call is enqueued on a stream of its own (after the caller's stream, so the tensor is
  ready) and waited for by polling a CUDA event, so a wait ends at its timeout or when the
  communicator is aborted;
* ``abort()`` is ``ncclCommAbort``, which ends the kernels still waiting on a dead peer.

vLLM's blocking ``ncclCommInitRank`` itself cannot be aborted: a peer that dies after the
store rendezvous but before NCCL's bootstrap leaves the helper thread blocked until the
process exits; the caller is released at the deadline all the same.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import Store

from refit_core.backend import in_thread
from refit_nccl.vllm_native.availability import require_vllm_nccl

__all__ = ["VllmNcclCommunicator"]

logger = logging.getLogger(__name__)

_POLL_S = 0.0005
"""How often a wait looks at its event and at the abort flag."""


class VllmNcclCommunicator:
    """One member of a vLLM NCCL weight-transfer group (refit's ``Communicator`` calls).

    Construction is quick; :meth:`connect` creates the NCCL communicator with vLLM's code.

    Raises:
        BackendNotInstalledError: vLLM's helpers do not import in this process.
        ValueError: a world of one (vLLM's communicator disables itself there).
    """

    def __init__(self, store: Store, rank: int, world_size: int, device: torch.device) -> None:
        require_vllm_nccl()
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if world_size < 2:
            raise ValueError("a vLLM NCCL weight-transfer group has a trainer and engine ranks")
        self._group = StatelessProcessGroup(rank=rank, world_size=world_size, store=store)
        # __init__ runs in connect(), on a helper thread: abort() can then reach the NCCL
        # communicator while vLLM's init still waits in its warm-up.
        self._comm: Any = PyNcclCommunicator.__new__(PyNcclCommunicator)
        self._device = device
        self._state = threading.Lock()
        self._aborted = False
        self._stream: torch.cuda.Stream | None = None

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` ran."""
        return self._aborted

    def connect(self, timeout: timedelta) -> None:
        """Run vLLM's communicator init (unique id, ``ncclCommInitRank``, warm-up).

        Raises:
            TimeoutError: it did not finish within ``timeout`` (the communicator is aborted).
            RuntimeError: the group was aborted meanwhile, or vLLM disabled the communicator
                (no NCCL library, or ``VLLM_DISABLE_PYNCCL``).
        """
        init = in_thread(self._comm.__init__, self._group, self._device, name="refit-vllm-nccl")
        end = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                init.result(timeout=min(0.05, max(0.0, end - time.monotonic())))
                break
            except FutureTimeout:
                if self._aborted:
                    raise RuntimeError("the group was aborted while vLLM's NCCL init ran") from None
                if time.monotonic() >= end:
                    self.abort()
                    raise TimeoutError(
                        f"vLLM's NCCL communicator init did not finish in "
                        f"{timeout.total_seconds():.3g} s (a peer did not join)"
                    ) from None
        if self._aborted:
            raise RuntimeError("the group was aborted while vLLM's NCCL init ran")
        if getattr(self._comm, "disabled", True):
            raise RuntimeError(
                "vLLM's PyNcclCommunicator disabled itself (its NCCL library did not load, or "
                "VLLM_DISABLE_PYNCCL is set)"
            )
        self._stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        logger.info(
            "vLLM NCCL communicator up: rank %d of %d on %s (nccl %s)",
            self._group.rank,
            self._group.world_size,
            self._device,
            self._comm.nccl_version,
        )

    # -- calls (refit's Communicator protocol) -------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _StreamCall:
        """Broadcast ``tensors[0]`` from ``opts.rootRank``."""
        tensor, root = tensors[0], int(opts.rootRank)
        return self._issue(tensor, lambda s: self._comm.broadcast(tensor, root, stream=s))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _StreamCall:
        """Reduce ``tensors[0]`` in place with ``opts.reduceOp``."""
        tensor, op = tensors[0], opts.reduceOp
        return self._issue(tensor, lambda s: self._comm.all_reduce(tensor, tensor, op, stream=s))

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> _StreamCall:  # noqa: N803
        """Send ``tensors[0]`` to ``dstRank`` (NCCL has no tags)."""
        tensor = tensors[0]
        return self._issue(tensor, lambda s: self._comm.send(tensor, dstRank, stream=s))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> _StreamCall:  # noqa: N803
        """Receive into ``tensors[0]`` from ``srcRank`` (NCCL has no tags)."""
        tensor = tensors[0]
        return self._issue(tensor, lambda s: self._comm.recv(tensor, srcRank, stream=s))

    def abort(self) -> None:
        """``ncclCommAbort``: ends every call still waiting on a peer; idempotent."""
        with self._state:
            if self._aborted:
                return
            self._aborted = True
        comm = getattr(self._comm, "comm", None)
        if comm is None or getattr(self._comm, "disabled", True):
            return
        with torch.cuda.device(self._device):
            self._comm.nccl.ncclCommAbort(comm)
        self._comm.disabled = True
        logger.info("vLLM NCCL communicator aborted (rank %d)", self._group.rank)

    def _issue(
        self, tensor: torch.Tensor, start: Callable[[torch.cuda.Stream], None]
    ) -> _StreamCall:
        stream = self._stream
        if stream is None or self._aborted:
            raise RuntimeError("the vLLM NCCL communicator is not connected or was aborted")
        stream.wait_stream(torch.cuda.current_stream(self._device))
        start(stream)
        tensor.record_stream(stream)
        finished = torch.cuda.Event()  # type: ignore[no-untyped-call]
        finished.record(stream)
        return _StreamCall(self, finished)


class _StreamCall:
    """An enqueued NCCL call; :meth:`wait` polls its event until done, timeout or abort."""

    def __init__(self, owner: VllmNcclCommunicator, finished: torch.cuda.Event) -> None:
        self._owner = owner
        self._finished = finished

    def wait(self, timeout: timedelta) -> bool:
        """Block until the call has completed; the caller's stream then sees its result.

        Raises:
            TimeoutError: it did not complete within ``timeout``.
            RuntimeError: the communicator was aborted first.
        """
        end = time.monotonic() + timeout.total_seconds()
        while not self._finished.query():  # type: ignore[no-untyped-call]
            if self._owner.aborted:
                raise RuntimeError("the vLLM NCCL communicator was aborted during the call")
            if time.monotonic() >= end:
                raise TimeoutError(f"NCCL call not complete after {timeout.total_seconds():.3g} s")
            time.sleep(_POLL_S)
        torch.cuda.current_stream().wait_event(self._finished)
        return True
