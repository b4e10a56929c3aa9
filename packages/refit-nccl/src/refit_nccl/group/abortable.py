"""An abortable process group outside torch.distributed's default world.

Each group rendezvouses over its own TCPStore (rank 0 hosts it on the given port, as vLLM's
stateless groups do), warms up with a one-element all-reduce, and runs every call under the
caller's :class:`~refit_core.backend.Deadline` (:mod:`refit_nccl.group.calls`). A call that
does not complete aborts the group; every later call raises
:class:`~refit_core.RefitAbortedError` naming that first cause (:mod:`refit_nccl.group.lifecycle`).
Store keys and warm-up follow refit's convention or vLLM's (:mod:`refit_nccl.group.rendezvous`),
so a vLLM peer can join.

The backend is given, or (``backend=None``) agreed at connect from the device every member
reports through the store, as SPMD deployments (Megatron) need: no controller decides.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, TCPStore

from refit_core.backend import Deadline
from refit_nccl.group.calls import REDUCE_OPS, DeadlineCalls, PendingCall, ReduceOpName
from refit_nccl.group.connect import (
    agree_on_backend,
    build_communicator,
    check_warm_up,
    rendezvous_error,
)
from refit_nccl.group.lifecycle import GroupLifecycle
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Backend, CallHandle, Communicator, traits_for

__all__ = ["AbortableProcessGroup"]

logger = logging.getLogger(__name__)


class AbortableProcessGroup:
    """A process group whose calls all end by their deadline and that can be aborted.

    Create it, then :meth:`connect`. :meth:`abort` is idempotent, never calls destroy
    (a collective that hangs when a peer is dead) and drops the communicator and the store
    once no call is in flight. Tensors must be contiguous and on :attr:`device`.
    """

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        traits = None if spec.backend is None else traits_for(spec.backend, spec.rendezvous)
        self._lifecycle = GroupLifecycle(spec.label, traits)
        self._calls = DeadlineCalls(spec, self._lifecycle)
        self._device: torch.device | None = None

    # -- state -------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This participant's rank."""
        return self.spec.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.spec.world_size

    @property
    def backend(self) -> Backend:
        """The communicator backend (agreed at connect when the spec names none)."""
        return self._lifecycle.known_traits.name

    @property
    def device(self) -> torch.device:
        """Device of the tensors this group moves."""
        if self._device is None:
            self._device = self._lifecycle.known_traits.device()
        return self._device

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` succeeded and the group is not aborted."""
        return self._lifecycle.connected

    @property
    def aborted(self) -> bool:
        """Whether the group was aborted."""
        return self._lifecycle.abort_cause is not None

    @property
    def abort_cause(self) -> str | None:
        """Why the group was aborted, or None."""
        return self._lifecycle.abort_cause

    # -- lifecycle ---------------------------------------------------------------------

    def connect(self, deadline: Deadline) -> None:
        """Rendezvous over the store, build the communicator and warm it up.

        Raises:
            RefitTimeoutError: a peer did not arrive before the deadline.
            RefitAbortedError: the group was aborted before or during the rendezvous.
            RefitError: the rendezvous failed otherwise (for example the port is taken).
            BackendNotInstalledError: this process cannot build the backend's communicator
                (vLLM's NCCL data plane without vLLM); nothing was joined.
        """
        spec, lifecycle = self.spec, self._lifecycle
        lifecycle.raise_if_aborted("connect")
        if lifecycle.holds_communicator:
            return
        if lifecycle.traits is not None:
            lifecycle.traits.require()
        logger.debug("%s: rendezvous at %s:%d", spec.label, spec.host, spec.port)
        with self._calls.guard(deadline, "rendezvous"):
            try:
                communicator, store = self._open(deadline)
            except Exception as exc:
                raise rendezvous_error(spec, exc, deadline, self.abort) from exc
        lifecycle.install(communicator, store)
        lifecycle.raise_if_aborted("connect")
        traits = lifecycle.known_traits
        with self._calls.guard(deadline, "communicator init"):
            try:
                timeout = self._calls.timeout(deadline, "communicator init")
                traits.connect(communicator, self.device, timeout)
            except Exception as exc:
                raise rendezvous_error(spec, exc, deadline, self.abort) from exc
        lifecycle.raise_if_aborted("connect")
        if not traits.warms_up_itself:
            self._warm_up(deadline)
        logger.info("%s: connected (%s on %s)", spec.label, traits.name, self.device)

    def _open(self, deadline: Deadline) -> tuple[Communicator, TCPStore | None]:
        """Meet the other ranks over the store and build the communicator (not connected)."""
        spec = self.spec
        timeout = self._calls.timeout(deadline, "rendezvous")
        store = TCPStore(
            spec.host,
            spec.port,
            spec.world_size,
            is_master=spec.rank == 0,
            timeout=timeout,
            wait_for_workers=True,
        )
        if self._lifecycle.traits is None:
            self._lifecycle.traits = agree_on_backend(spec, store)
        communicator = build_communicator(spec, self._lifecycle.traits, store, timeout, self.device)
        return communicator, store

    def _warm_up(self, deadline: Deadline) -> None:
        """The convention's one-element all-reduce; it must sum to what the convention says."""
        value = self.spec.convention.warm_up_value
        if value is None:
            return
        probe = torch.full((1,), value, device=self.device)
        self.all_reduce(probe, deadline)
        check_warm_up(self.spec, probe.item(), self.abort)

    def abort(self, cause: str = "aborted by its owner") -> None:
        """Make the group unusable; idempotent, safe from any thread, never blocks on peers."""
        self._lifecycle.abort(cause)

    # -- calls -------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        """Broadcast ``tensor`` from ``root`` into every rank's ``tensor``."""
        self.broadcast_async(tensor, root, deadline).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> PendingCall:
        """Issue a broadcast; the caller must :meth:`PendingCall.wait` before reusing ``tensor``."""
        self._check_tensor(tensor)
        self._check_rank(root)

        def start(communicator: Communicator, timeout: timedelta) -> CallHandle:
            options = BroadcastOptions()
            options.rootRank = root
            options.rootTensor = 0
            if self._lifecycle.known_traits.per_call_timeout:
                options.timeout = timeout
            return communicator.broadcast([tensor], options)

        return self._calls.issue(f"broadcast from {root}", deadline, start, rewaitable=True)

    def all_reduce(
        self, tensor: torch.Tensor, deadline: Deadline, op: ReduceOpName = "sum"
    ) -> None:
        """Reduce ``tensor`` in place across all ranks."""
        self._check_tensor(tensor)
        reduce_op = REDUCE_OPS[op]

        def start(communicator: Communicator, timeout: timedelta) -> CallHandle:
            options = AllreduceOptions()
            options.reduceOp = reduce_op
            if self._lifecycle.known_traits.per_call_timeout:
                options.timeout = timeout
            return communicator.allreduce([tensor], options)

        self._calls.issue(f"all_reduce {op}", deadline, start, rewaitable=True).wait()

    def send(self, tensor: torch.Tensor, dst: int, deadline: Deadline, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``."""
        self._check_tensor(tensor)
        self._check_rank(dst)
        self._calls.issue(
            f"send to {dst}", deadline, lambda c, _: c.send([tensor], dst, tag)
        ).wait()

    def recv(self, tensor: torch.Tensor, src: int, deadline: Deadline, tag: int = 0) -> None:
        """Receive into ``tensor`` from rank ``src``."""
        self._check_tensor(tensor)
        self._check_rank(src)
        self._calls.issue(
            f"recv from {src}", deadline, lambda c, _: c.recv([tensor], src, tag)
        ).wait()

    def barrier(self, deadline: Deadline) -> None:
        """Block until every rank has reached the barrier."""
        # An all-reduce rather than the backend barrier: NCCL's barrier guesses a device
        # and gloo's ignores per-call timeouts.
        self.all_reduce(torch.zeros(1, device=self.device), deadline)

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(f"tensor is on {tensor.device}, the group moves {self.device}")
        if not tensor.is_contiguous():
            raise ValueError("collective tensors must be contiguous")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
