"""A process group whose communicator runs in a child process that is killed on abort.

The fallback for a communicator whose calls neither take a timeout nor end when it is aborted
(the design torchft uses): the child owns the real communicator (an
:class:`~refit_nccl.group.AbortableProcessGroup`: same rendezvous, same warm-up) and runs the
calls the parent sends over a socket pair; tensors travel through shared-memory buffers
(files in ``/dev/shm`` that both map, unlinked once the child has them) registered with the
child once: one copy in before a call, one copy out after it. The parent waits for each reply
at most until the call's deadline; past it, or on abort, it SIGKILLs the child, which ends
every call in it whatever the backend does. A group is connected once, so the next rendezvous
(a reconcile) starts a fresh child. The child is a plain subprocess of the same interpreter
(not a multiprocessing child), so daemonic processes can use it too; it exits when the parent
goes away (its end of the socket closes).

CPU tensors only (gloo): a CUDA communicator in a child would need CUDA IPC handles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
from torch._C._distributed_c10d import TCPStore

from refit_core import (
    GeometryMismatchError,
    ProtocolError,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
)
from refit_core.backend import Deadline
from refit_nccl.backends import Communicator
from refit_nccl.group import REDUCE_OPS, AbortableProcessGroup, GroupSpec, ReduceOpName
from refit_nccl.packing import wire_view

__all__ = ["ChildCommunicator", "ChildProcessGroup", "make_group", "serve"]

logger = logging.getLogger(__name__)


_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (RefitTimeoutError, RefitAbortedError, ProtocolError, GeometryMismatchError)
}
"""Errors the child reports that keep their type in the parent (others become RefitError)."""

_REAP_S = 1.0
"""How long abort waits for the killed child to be reaped."""


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call for the child: ``op`` on the first ``nbytes`` of buffer ``buffer``."""

    call_id: int
    op: str
    buffer: int
    nbytes: int
    dtype: torch.dtype
    peer: int
    timeout_s: float | None
    reduce: ReduceOpName = "sum"
    tag: int = 0


def _error_from(name: str, message: str) -> Exception:
    cls = _ERRORS.get(name)
    return cls(message) if cls is not None else RefitError(f"{name}: {message}")


@dataclasses.dataclass(frozen=True)
class _Reply:
    """The child's answer to one call: its error's type name and message, or None."""

    call_id: int
    error: tuple[str, str] | None


class _ChildCall:
    """A call issued to the child; :meth:`wait` blocks for its reply, then copies out."""

    def __init__(
        self,
        comm: ChildCommunicator,
        call_id: int,
        buffer: torch.Tensor,
        out: torch.Tensor | None,
    ) -> None:
        self._comm = comm
        self._call_id = call_id
        self._buffer = buffer
        self._out = out

    def wait(self, timeout: timedelta) -> bool:
        """Wait up to ``timeout`` for the reply; raises the child's error or TimeoutError."""
        try:
            self._comm._await(self._call_id, timeout.total_seconds())
            if self._out is not None:
                np.copyto(self._out.numpy(), self._buffer[: self._out.numel()].numpy())
        finally:
            self._comm._buffers.release(self._buffer)
        return True


def _shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _SharedBuffers:
    """Shared-memory byte buffers known to the child, reused across calls.

    Each is a file both processes map; the parent unlinks it once a call that used it has
    ended (the child mapped it when it registered it), or at :meth:`clear`.
    """

    def __init__(self, register: Callable[[int, str, int], None]) -> None:
        self._register = register
        self._free: list[tuple[int, torch.Tensor]] = []
        self._ids: dict[int, int] = {}  # data_ptr -> id
        self._paths: dict[int, str] = {}  # id -> file not yet unlinked
        self._count = itertools.count()
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        with self._lock:
            fits = [entry for entry in self._free if entry[1].numel() >= nbytes]
            if fits:
                entry = min(fits, key=lambda e: e[1].numel())
                self._free.remove(entry)
                return entry
            index = next(self._count)
            path = os.path.join(_shared_dir(), f"refit-child-{uuid.uuid4().hex}")
            size = max(nbytes, 1)
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._ids[buffer.data_ptr()] = index
            self._paths[index] = path
        self._register(index, path, size)
        return index, buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            index = self._ids.get(buffer.data_ptr())
            if index is None:  # cleared by an abort
                return
            self._free.append((index, buffer))
            path = self._paths.pop(index, None)
        if path is not None:
            _unlink(path)

    def clear(self) -> None:
        with self._lock:
            paths = list(self._paths.values())
            self._free.clear()
            self._ids.clear()
            self._paths.clear()
        for path in paths:
            _unlink(path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ChildCommunicator:
    """The parent's end of a communicator that runs in a child process.

    Each call copies its tensor into a shared buffer, sends one command and returns a handle
    whose ``wait(timeout)`` reads the reply. :meth:`abort` SIGKILLs the child.
    """

    def __init__(
        self, process: subprocess.Popen[bytes], conn: Connection, label: str, rank: int
    ) -> None:
        self._process = process
        self._rank = rank
        self._conn = conn
        self._label = label
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._replies: dict[int, _Reply] = {}
        self._ids = itertools.count()
        self._buffers = _SharedBuffers(self._register)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _ChildCall:
        root = int(opts.rootRank)
        sending = root == self._rank
        return self._issue(
            "broadcast", tensors[0], root, opts.timeout, send=sending, out=not sending
        )

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _ChildCall:
        reduce = next(name for name, op in REDUCE_OPS.items() if opts.reduceOp == op)
        return self._issue("all_reduce", tensors[0], 0, opts.timeout, True, True, reduce=reduce)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> _ChildCall:  # noqa: N803
        return self._issue("send", tensors[0], dstRank, None, send=True, out=False, tag=tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> _ChildCall:  # noqa: N803
        return self._issue("recv", tensors[0], srcRank, None, send=False, out=True, tag=tag)

    def abort(self) -> None:
        """SIGKILL the child (ends every call in it) and reap it; idempotent."""
        if self._process.poll() is None:
            logger.info("%s: killing the communicator's child %d", self._label, self._process.pid)
            self._process.kill()
        try:
            self._process.wait(_REAP_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s: child %d not reaped yet", self._label, self._process.pid)
        self._conn.close()
        self._buffers.clear()

    # -- internals ---------------------------------------------------------------------

    def _issue(
        self,
        op: str,
        tensor: torch.Tensor,
        peer: int,
        timeout: timedelta | None,
        send: bool,
        out: bool,
        *,
        reduce: ReduceOpName = "sum",
        tag: int = 0,
    ) -> _ChildCall:
        wire = wire_view(tensor.detach())
        index, buffer = self._buffers.acquire(wire.numel())
        if send:
            np.copyto(buffer[: wire.numel()].numpy(), wire.numpy())
        call = _Call(
            next(self._ids),
            op,
            index,
            wire.numel(),
            tensor.dtype,
            peer,
            None if timeout is None else timeout.total_seconds(),
            reduce,
            tag,
        )
        try:
            self._send(call)
        except BaseException:
            self._buffers.release(buffer)
            raise
        return _ChildCall(self, call.call_id, buffer, wire if out else None)

    def _register(self, index: int, path: str, size: int) -> None:
        self._send(("register", index, path, size))

    def _send(self, message: object) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:
                raise ConnectionError(f"{self._label}: the communicator's child is gone") from exc

    def _await(self, call_id: int, timeout_s: float) -> None:
        deadline = Deadline.after(max(timeout_s, 0.0))
        with self._recv_lock:
            while call_id not in self._replies:
                left = deadline.remaining_s() or 0.0
                try:
                    ready = self._conn.poll(left)
                    reply: _Reply | None = self._conn.recv() if ready else None
                except (EOFError, OSError, ValueError) as exc:
                    raise ConnectionError(
                        f"{self._label}: the communicator's child is gone (exit status "
                        f"{self._process.poll()}): {exc!r}"
                    ) from exc
                if reply is None:
                    raise TimeoutError(
                        f"{self._label}: no reply from the child in {timeout_s:.3f} s"
                    )
                self._replies[reply.call_id] = reply
            reply = self._replies.pop(call_id)
        if reply.error is not None:
            raise _error_from(*reply.error)


class ChildProcessGroup(AbortableProcessGroup):
    """An :class:`AbortableProcessGroup` whose communicator runs in a spawned child.

    Same API, rendezvous and warm-up (run by the child); every call is bounded by its
    deadline in the parent, and abort (or a call past its deadline) SIGKILLs the child, so no
    call outlives its deadline whatever the backend does. CPU tensors (gloo) only.
    """

    def __init__(self, spec: GroupSpec) -> None:
        super().__init__(dataclasses.replace(spec, in_child=True))
        # The parent bounds every wait itself; killing the child is what releases it.
        self._traits = dataclasses.replace(
            self._known_traits(),
            per_call_timeout=True,
            abort_releases=False,
            waits_in_slices=False,
        )

    def _open(self, deadline: Deadline) -> tuple[Communicator, TCPStore | None]:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        conn = Connection(ours.detach())
        comm = ChildCommunicator(process, conn, self.spec.label, self.spec.rank)
        try:
            comm._send((self.spec, deadline.remaining_s()))
            comm._await(-1, self._timeout(deadline, "rendezvous").total_seconds())
        except BaseException:
            comm.abort()
            raise
        return comm, None

    def _warm_up(self, deadline: Deadline) -> None:
        """The child's group warmed up when it connected."""


def make_group(spec: GroupSpec) -> AbortableProcessGroup:
    """The group ``spec`` asks for: in a child process if ``spec.in_child``, else in this one."""
    return ChildProcessGroup(spec) if spec.in_child else AbortableProcessGroup(spec)


_CHILD_MAIN = "import sys; from refit_nccl.child import serve; serve(int(sys.argv[1]))"


def serve(fd: int) -> None:
    """Child process entry: connect the parent's group over the socket ``fd``, then run the
    parent's calls in order until the parent goes away."""
    torch.set_num_threads(1)
    conn = Connection(fd)
    spec, connect_timeout_s = conn.recv()
    group = AbortableProcessGroup(dataclasses.replace(spec, in_child=False))
    try:
        group.connect(Deadline.after(connect_timeout_s))
    except Exception as exc:
        conn.send(_Reply(-1, (type(exc).__name__, str(exc))))
        return
    conn.send(_Reply(-1, None))
    buffers: dict[int, torch.Tensor] = {}
    waits: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
    replier = threading.Thread(target=_reply_in_order, args=(conn, waits), daemon=True)
    replier.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if isinstance(message, tuple):
            _, index, path, size = message
            buffers[index] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            continue
        waits.put((message.call_id, _start(group, message, buffers[message.buffer])))
    waits.put(None)
    group.abort("the parent went away")


def _start(group: AbortableProcessGroup, call: _Call, buffer: torch.Tensor) -> Callable[[], None]:
    """Issue ``call`` on ``group``; the returned function completes it (raising its error)."""
    data = buffer[: call.nbytes]
    deadline = Deadline.after(call.timeout_s)
    try:
        if call.op == "broadcast":
            return group.broadcast_async(data, call.peer, deadline).wait
        if call.op == "all_reduce":
            group.all_reduce(data.view(call.dtype), deadline, op=call.reduce)
        elif call.op == "send":
            group.send(data, call.peer, deadline, call.tag)
        else:
            group.recv(data, call.peer, deadline, call.tag)
    except Exception as exc:
        error = exc

        def fail() -> None:
            raise error

        return fail
    return lambda: None


def _reply_in_order(
    conn: Connection, waits: queue.SimpleQueue[tuple[int, Callable[[], None]] | None]
) -> None:
    while (item := waits.get()) is not None:
        call_id, complete = item
        try:
            complete()
            reply = _Reply(call_id, None)
        except Exception as exc:
            reply = _Reply(call_id, (type(exc).__name__, str(exc)))
        try:
            conn.send(reply)
        except OSError:
            return
