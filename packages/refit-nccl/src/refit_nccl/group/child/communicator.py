"""The parent's end of a communicator that runs in a child process (:class:`ChildCommunicator`)."""

from __future__ import annotations

import itertools
import logging
import subprocess
import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from refit_core.backend import Deadline
from refit_nccl.group.calls import REDUCE_OPS, ReduceOpName
from refit_nccl.group.child.buffers import SharedBuffers
from refit_nccl.group.child.messages import ChildCall, ChildReply
from refit_nccl.group.tensors import wire_view

__all__ = ["ChildCommunicator"]

logger = logging.getLogger(__name__)

_REAP_S = 1.0
"""How long abort waits for the killed child to be reaped."""


class _IssuedCall:
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
            self._comm.await_reply(self._call_id, timeout.total_seconds())
            if self._out is not None:
                np.copyto(self._out.numpy(), self._buffer[: self._out.numel()].numpy())
        finally:
            self._comm.buffers.release(self._buffer)
        return True


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
        self._replies: dict[int, ChildReply] = {}
        self._ids = itertools.count()
        self.buffers = SharedBuffers(self._register)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _IssuedCall:
        root = int(opts.rootRank)
        sending = root == self._rank
        return self._issue(
            "broadcast", tensors[0], root, opts.timeout, send=sending, out=not sending
        )

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _IssuedCall:
        reduce = next(name for name, op in REDUCE_OPS.items() if opts.reduceOp == op)
        return self._issue("all_reduce", tensors[0], 0, opts.timeout, True, True, reduce=reduce)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> _IssuedCall:  # noqa: N803
        return self._issue("send", tensors[0], dstRank, None, send=True, out=False, tag=tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> _IssuedCall:  # noqa: N803
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
        self.buffers.clear()

    def send_message(self, message: object) -> None:
        """Send one message to the child.

        Raises:
            ConnectionError: the child is gone.
        """
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:
                raise ConnectionError(f"{self._label}: the communicator's child is gone") from exc

    def await_reply(self, call_id: int, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the child's reply to ``call_id``; raise its error.

        Raises:
            TimeoutError: no reply in time.
            ConnectionError: the child is gone.
        """
        deadline = Deadline.after(max(timeout_s, 0.0))
        with self._recv_lock:
            while call_id not in self._replies:
                left = deadline.remaining_s() or 0.0
                try:
                    ready = self._conn.poll(left)
                    reply: ChildReply | None = self._conn.recv() if ready else None
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
        reply.raise_error()

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
    ) -> _IssuedCall:
        wire = wire_view(tensor.detach())
        index, buffer = self.buffers.acquire(wire.numel())
        if send:
            np.copyto(buffer[: wire.numel()].numpy(), wire.numpy())
        call = ChildCall(
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
            self.send_message(call)
        except BaseException:
            self.buffers.release(buffer)
            raise
        return _IssuedCall(self, call.call_id, buffer, wire if out else None)

    def _register(self, index: int, path: str, size: int) -> None:
        self.send_message(("register", index, path, size))
