"""An abortable process group outside torch.distributed's default world.

Each group rendezvouses over its own TCPStore (rank 0 hosts it on the given port, as vLLM's
stateless groups do), warms up with a one-element all-reduce, and runs every call under the
caller's :class:`~refit_core.backend.Deadline`: the remaining time is passed to calls that take a
timeout (gloo) and a watchdog aborts the communicator where abort releases calls (NCCL).
A call that does not complete aborts the group; every later call raises
:class:`~refit_core.RefitAbortedError` naming that first cause. Store keys and warm-up follow
refit's convention or vLLM's (:mod:`refit_nccl.rendezvous`), so a vLLM peer can join.

The backend is given, or (``backend=None``) agreed at connect from the device every member
reports through the store, as SPMD deployments (Megatron) need: no controller decides.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, cast

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceOp,
    TCPStore,
)
from torch.distributed import DistStoreError

from refit_core import ProtocolError, RefitAbortedError, RefitError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_nccl.backends import (
    Backend,
    BackendTraits,
    CallHandle,
    Communicator,
    RewaitableHandle,
    traits_for,
)
from refit_nccl.devices import DeviceReport, DeviceType, choose_backend, native_backend
from refit_nccl.rendezvous import Convention, Rendezvous, convention_of
from refit_nccl.watchdog import Watchdog

__all__ = [
    "DISARMED_TIMEOUT_S",
    "REDUCE_OPS",
    "AbortableProcessGroup",
    "GroupSpec",
    "PendingCall",
    "ReduceOpName",
]

logger = logging.getLogger(__name__)

ReduceOpName = Literal["sum", "max", "min"]

REDUCE_OPS: dict[ReduceOpName, ReduceOp.RedOpType] = {
    "sum": ReduceOp.SUM,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
}

DISARMED_TIMEOUT_S = 1800.0
"""Timeout of calls made under a disarmed deadline (torch's own default)."""

_MIN_WAIT_S = 0.001
"""Work.wait treats a zero timeout as "no timeout"; never pass less than this."""

_ABORT_POLL_S = 0.05
"""How often a caller blocked in a gloo call checks whether its group was aborted."""

_DEADLINE_SLOP_S = 0.1
"""A call failing this close to its deadline is reported as a timeout (gloo's own timer
fires a hair before the deadline the timeout was derived from)."""


@dataclass(frozen=True)
class GroupSpec:
    """Who a participant is in one group and where the group meets.

    Attributes:
        host: address of the TCPStore that rank 0 hosts.
        port: the store's port; use a fresh one per group.
        rank: this participant's rank.
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None: the members agree on it at
            connect from the devices they report (:func:`~refit_nccl.devices.choose_backend`).
        name: the group's name (prefix of its store keys under refit's rendezvous).
        disarmed_timeout_s: timeout of calls made under a disarmed deadline.
        rendezvous: whose store keys and warm-up the group follows: ``"refit"``, ``"vllm"``
            for a group that vLLM's peers join (:mod:`refit_nccl.rendezvous`): on gloo vLLM's
            stateless torch group, on ``nccl`` vLLM's own ``PyNcclCommunicator``
            (:mod:`refit_nccl.vllm_native`, which needs vLLM importable here), or ``"sglang"``
            for one that SGLang's ``init_custom_process_group`` joins.
        in_child: run the communicator in a child process that is killed at the deadline
            or on abort (:class:`~refit_nccl.child.ChildProcessGroup`; gloo only); build the
            group with :func:`~refit_nccl.child.make_group`.
        device: the device this member reports when ``backend`` is None (None: this
            process's); ignored otherwise.
    """

    host: str
    port: int
    rank: int
    world_size: int
    backend: Backend | None = "gloo"
    name: str = "refit"
    disarmed_timeout_s: float = DISARMED_TIMEOUT_S
    rendezvous: Rendezvous = "refit"
    in_child: bool = False
    device: DeviceType | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.disarmed_timeout_s > 0:
            raise ValueError(f"disarmed_timeout_s must be > 0, got {self.disarmed_timeout_s}")
        if self.backend is not None:
            traits_for(self.backend, self.rendezvous)
        convention_of(self.rendezvous)
        if self.rendezvous != "refit" and self.backend is None:
            raise ValueError(f"a {self.rendezvous} peer joins a group of a known backend; name it")
        if self.device is not None:
            native_backend(self.device)
        if self.in_child and self.backend != "gloo":
            raise ValueError(
                "a child-process communicator moves CPU tensors (gloo); CUDA tensors would "
                "need CUDA IPC handles, which are not built"
            )

    @property
    def convention(self) -> Convention:
        """The rendezvous convention the group follows."""
        return convention_of(self.rendezvous)

    @property
    def label(self) -> str:
        """``name rank r/n`` for messages."""
        return f"{self.name} rank {self.rank}/{self.world_size}"


class PendingCall:
    """An issued call; :meth:`wait` blocks until it completes or its deadline passes."""

    def __init__(
        self,
        group: AbortableProcessGroup,
        what: str,
        work: CallHandle,
        deadline: Deadline,
        *,
        rewaitable: bool,
    ) -> None:
        self._group = group
        self._work: CallHandle | None = work
        self.what = what
        self.deadline = deadline
        self.rewaitable = rewaitable

    def wait(self) -> None:
        """Block until the call completes; idempotent.

        Raises:
            RefitTimeoutError: the call did not complete by its deadline, or a peer failed;
                the group is aborted.
            RefitAbortedError: the group was aborted by its owner while the call ran.
        """
        work, self._work = self._work, None
        if work is not None:
            self._group._complete(self, work)


class AbortableProcessGroup:
    """A process group whose calls all end by their deadline and that can be aborted.

    Create it, then :meth:`connect`. :meth:`abort` is idempotent, never calls destroy
    (a collective that hangs when a peer is dead) and drops the communicator and the store
    once no call is in flight. Tensors must be contiguous and on :attr:`device`.
    """

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self._traits: BackendTraits | None = (
            None if spec.backend is None else traits_for(spec.backend, spec.rendezvous)
        )
        self._lock = threading.Lock()
        self._pg: Communicator | None = None
        self._store: TCPStore | None = None
        self._abort_cause: str | None = None
        self._in_flight = 0
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
        return self._known_traits().name

    @property
    def device(self) -> torch.device:
        """Device of the tensors this group moves."""
        if self._device is None:
            self._device = self._known_traits().device()
        return self._device

    def _known_traits(self) -> BackendTraits:
        if self._traits is None:
            raise RuntimeError(f"{self.spec.label}: the backend is agreed at connect()")
        return self._traits

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` succeeded and the group is not aborted."""
        with self._lock:
            return self._pg is not None and self._abort_cause is None

    @property
    def aborted(self) -> bool:
        """Whether the group was aborted."""
        return self._abort_cause is not None

    @property
    def abort_cause(self) -> str | None:
        """Why the group was aborted, or None."""
        return self._abort_cause

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
        spec = self.spec
        with self._lock:
            self._raise_if_aborted("connect")
            if self._pg is not None:
                return
        if self._traits is not None:
            self._traits.require()
        logger.debug("%s: rendezvous at %s:%d", spec.label, spec.host, spec.port)
        with self._guard(deadline, "rendezvous"):
            try:
                pg, store = self._open(deadline)
            except Exception as exc:
                raise self._rendezvous_error(exc, deadline) from exc
        with self._lock:
            if self._abort_cause is None:
                self._pg, self._store = pg, store
        self._raise_if_aborted("connect")
        traits = self._known_traits()
        with self._guard(deadline, "communicator init"):
            try:
                traits.connect(pg, self.device, self._timeout(deadline, "communicator init"))
            except Exception as exc:
                raise self._rendezvous_error(exc, deadline) from exc
        self._raise_if_aborted("connect")
        if not traits.warms_up_itself:
            self._warm_up(deadline)
        logger.info("%s: connected (%s on %s)", spec.label, traits.name, self.device)

    def _open(self, deadline: Deadline) -> tuple[Communicator, TCPStore | None]:
        """Meet the other ranks over the store and build the communicator (not connected)."""
        spec = self.spec
        timeout = self._timeout(deadline, "rendezvous")
        store = TCPStore(
            spec.host,
            spec.port,
            spec.world_size,
            is_master=spec.rank == 0,
            timeout=timeout,
            wait_for_workers=True,
        )
        if self._traits is None:
            agreeing = spec.convention.store_prefix(spec.name, spec.host, spec.port, None)
            self._traits = self._agree_on_backend(PrefixStore(agreeing, store))
        traits = self._traits
        prefix = spec.convention.store_prefix(spec.name, spec.host, spec.port, traits.name)
        construct_timeout = (
            timeout if traits.per_call_timeout else timedelta(seconds=spec.disarmed_timeout_s)
        )
        pg = traits.construct(
            store if traits.raw_store else PrefixStore(prefix, store),
            spec.rank,
            spec.world_size,
            construct_timeout,
            spec.host,
            self.device,
        )
        return pg, store

    def _agree_on_backend(self, store: PrefixStore) -> BackendTraits:
        """Publish this member's device report, read everyone's, choose the backend.

        Every member reads the same reports and so reaches the same verdict; a mismatch
        raises :class:`~refit_nccl.devices.DeviceMismatchError` on all of them.
        """
        spec = self.spec
        mine = DeviceReport.of(spec.device)
        store.set(f"device/{spec.rank}", f"{mine.device} {' '.join(mine.backends)}")
        keys = [f"device/{rank}" for rank in range(spec.world_size)]
        store.wait(keys)
        reports: dict[str, DeviceReport] = {}
        for rank, key in enumerate(keys):
            device, *backends = store.get(key).decode().split()
            reports[f"rank {rank}"] = DeviceReport(
                cast(DeviceType, device), cast(tuple[Backend, ...], tuple(backends))
            )
        backend = choose_backend(reports)
        logger.info("%s: members agreed on %s", spec.label, backend)
        return traits_for(backend, spec.rendezvous)

    def _warm_up(self, deadline: Deadline) -> None:
        """The convention's one-element all-reduce; it must sum to what the convention says."""
        convention = self.spec.convention
        if convention.warm_up_value is None:
            return
        probe = torch.full((1,), convention.warm_up_value, device=self.device)
        self.all_reduce(probe, deadline)
        expected = convention.expected_warm_up(self.world_size)
        if probe.item() != expected:
            cause = f"warm-up all-reduce summed to {probe.item()}, not {expected}"
            self.abort(cause)
            raise ProtocolError(f"{self.spec.label}: {cause} (a member follows another rendezvous)")

    def abort(self, cause: str = "aborted by its owner") -> None:
        """Make the group unusable; idempotent, safe from any thread, never blocks on peers."""
        with self._lock:
            if self._abort_cause is not None:
                return
            self._abort_cause = cause
            pg = self._pg
        logger.info("%s: aborted: %s", self.spec.label, cause)
        if pg is not None:
            try:
                pg.abort()
            except Exception:
                logger.debug("%s: backend abort failed", self.spec.label, exc_info=True)
        with self._lock:
            self._release_if_idle()

    # -- calls -------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> None:
        """Broadcast ``tensor`` from ``root`` into every rank's ``tensor``."""
        self.broadcast_async(tensor, root, deadline).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int, deadline: Deadline) -> PendingCall:
        """Issue a broadcast; the caller must :meth:`PendingCall.wait` before reusing ``tensor``."""
        self._check_tensor(tensor)
        self._check_rank(root)

        def start(pg: Communicator, timeout: timedelta) -> CallHandle:
            options = BroadcastOptions()
            options.rootRank = root
            options.rootTensor = 0
            if self._known_traits().per_call_timeout:
                options.timeout = timeout
            return pg.broadcast([tensor], options)

        return self._issue(f"broadcast from {root}", deadline, start, rewaitable=True)

    def all_reduce(
        self, tensor: torch.Tensor, deadline: Deadline, op: ReduceOpName = "sum"
    ) -> None:
        """Reduce ``tensor`` in place across all ranks."""
        self._check_tensor(tensor)
        reduce_op = REDUCE_OPS[op]

        def start(pg: Communicator, timeout: timedelta) -> CallHandle:
            options = AllreduceOptions()
            options.reduceOp = reduce_op
            if self._known_traits().per_call_timeout:
                options.timeout = timeout
            return pg.allreduce([tensor], options)

        self._issue(f"all_reduce {op}", deadline, start, rewaitable=True).wait()

    def send(self, tensor: torch.Tensor, dst: int, deadline: Deadline, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``."""
        self._check_tensor(tensor)
        self._check_rank(dst)
        self._issue(f"send to {dst}", deadline, lambda pg, _: pg.send([tensor], dst, tag)).wait()

    def recv(self, tensor: torch.Tensor, src: int, deadline: Deadline, tag: int = 0) -> None:
        """Receive into ``tensor`` from rank ``src``."""
        self._check_tensor(tensor)
        self._check_rank(src)
        self._issue(f"recv from {src}", deadline, lambda pg, _: pg.recv([tensor], src, tag)).wait()

    def barrier(self, deadline: Deadline) -> None:
        """Block until every rank has reached the barrier."""
        # An all-reduce rather than the backend barrier: NCCL's barrier guesses a device
        # and gloo's ignores per-call timeouts.
        self.all_reduce(torch.zeros(1, device=self.device), deadline)

    # -- internals ---------------------------------------------------------------------

    def _issue(
        self,
        what: str,
        deadline: Deadline,
        start: Callable[[Communicator, timedelta], CallHandle],
        *,
        rewaitable: bool = False,
    ) -> PendingCall:
        """Start a call; ``rewaitable``: its ``wait`` may time out and be waited on again
        (gloo's collectives; a timed-out wait of a gloo send or recv closes the pair)."""
        with self._lock:
            self._raise_if_aborted(what)
            pg = self._pg
            if pg is None:
                raise RuntimeError(f"{self.spec.label}: {what} before connect()")
            self._in_flight += 1
        try:
            timeout = self._timeout(deadline, what)
            with self._guard(deadline, what):
                work = start(pg, timeout)
        except BaseException as exc:
            self._settle()
            raise self._failure(what, exc, deadline) from exc
        return PendingCall(self, what, work, deadline, rewaitable=rewaitable)

    def _complete(self, call: PendingCall, work: CallHandle) -> None:
        try:
            if self._known_traits().waits_in_slices and call.rewaitable:
                self._wait_in_slices(call, work)
            else:
                timeout = self._timeout(call.deadline, call.what)
                with self._guard(call.deadline, call.what):
                    work.wait(max(timeout, timedelta(seconds=_MIN_WAIT_S)))
        except BaseException as exc:
            raise self._failure(call.what, exc, call.deadline) from exc
        finally:
            self._settle()

    def _wait_in_slices(self, call: PendingCall, work: CallHandle) -> None:
        """Wait for ``work``, leaving it (still running) as soon as the group is aborted.

        Raises:
            RefitAbortedError: the group was aborted while the call ran.
        """
        ends = time.monotonic() + self._timeout(call.deadline, call.what).total_seconds()
        while True:
            left_s = ends - time.monotonic()
            wait_s = min(left_s, _ABORT_POLL_S)
            try:
                work.wait(timedelta(seconds=max(wait_s, _MIN_WAIT_S)))
                return
            except RuntimeError:
                if wait_s >= left_s:  # the whole wait is spent
                    raise
                if cast(RewaitableHandle, work).is_completed():
                    # The call ended, possibly just as the slice timed out: its own outcome
                    # (success, or the group's error) decides, not the slice's timeout.
                    work.wait(timedelta(seconds=_MIN_WAIT_S))
                    return
            cause = self._abort_cause
            if cause is not None:
                raise RefitAbortedError(
                    f"{self.spec.label}: {call.what} abandoned: the group was aborted ({cause})"
                )

    def _timeout(self, deadline: Deadline, what: str) -> timedelta:
        remaining = deadline.remaining_s()
        if remaining is None:
            return timedelta(seconds=self.spec.disarmed_timeout_s)
        if remaining <= 0:
            raise RefitTimeoutError(f"{self.spec.label}: deadline passed before {what}")
        return timedelta(seconds=remaining)

    def _guard(self, deadline: Deadline, what: str) -> contextlib.AbstractContextManager[object]:
        if self._traits is None or not self._traits.abort_releases:
            return contextlib.nullcontext()
        cause = f"{what} passed its deadline"
        return Watchdog(deadline, lambda: self.abort(cause), what=f"{self.spec.label}: {what}")

    def _failure(self, what: str, exc: BaseException, deadline: Deadline) -> BaseException:
        """The error to raise for a call that did not complete; aborts the group."""
        if isinstance(exc, RefitError) or not isinstance(exc, Exception):
            self.abort(f"{what}: {exc!r}")
            return exc
        prior = self._abort_cause
        if prior is not None and not deadline.expired():
            return RefitAbortedError(
                f"{self.spec.label}: {what} ended because the group was aborted: {prior}"
            )
        remaining = deadline.remaining_s()
        reason = (
            "passed its deadline"
            if remaining is not None and remaining <= _DEADLINE_SLOP_S
            else "failed (a peer was lost)"
        )
        cause = f"{self.spec.label}: {what} {reason}: {_first_line(exc)}"
        logger.warning("%s; aborting the group", cause)
        self.abort(cause)
        return RefitTimeoutError(f"{cause}; the group is aborted")

    def _rendezvous_error(self, exc: BaseException, deadline: Deadline) -> RefitError:
        if isinstance(exc, RefitError):
            self.abort(str(exc))
            return exc
        cause = f"{self.spec.label}: rendezvous at {self.spec.host}:{self.spec.port} failed"
        self.abort(f"{cause}: {_first_line(exc)}")
        if deadline.expired() or isinstance(exc, TimeoutError | DistStoreError):
            return RefitTimeoutError(f"{cause} by its deadline: {_first_line(exc)}")
        return RefitError(f"{cause}: {_first_line(exc)}", is_retryable=True)

    def _raise_if_aborted(self, what: str) -> None:
        if self._abort_cause is not None:
            raise RefitAbortedError(
                f"{self.spec.label}: {what} on an aborted group (cause: {self._abort_cause})"
            )

    def _settle(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._release_if_idle()

    def _release_if_idle(self) -> None:
        """Drop communicator and store once aborted and idle (lock held)."""
        if self._abort_cause is not None and self._in_flight == 0:
            self._pg = None
            self._store = None

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(f"tensor is on {tensor.device}, the group moves {self.device}")
        if not tensor.is_contiguous():
            raise ValueError("collective tensors must be contiguous")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception (torch appends C++ stack traces)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
