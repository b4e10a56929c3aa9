"""The communicator's child process: connects the parent's group, then runs its calls."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from refit_core.backend import Deadline
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.child.messages import CONNECT_ID, ChildCall, ChildReply

__all__ = ["serve"]


def serve(fd: int) -> None:
    """Child process entry: connect the parent's group over the socket ``fd``, then run the
    parent's calls in order until the parent goes away."""
    torch.set_num_threads(1)
    conn = Connection(fd)
    spec, connect_deadline = conn.recv()
    group = AbortableProcessGroup(dataclasses.replace(spec, in_child=False))
    try:
        group.connect(Deadline.from_wire(connect_deadline))
    except Exception as exc:
        conn.send(ChildReply.failed(CONNECT_ID, exc))
        return
    conn.send(ChildReply(CONNECT_ID, None))
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


def _start(
    group: AbortableProcessGroup, call: ChildCall, buffer: torch.Tensor
) -> Callable[[], None]:
    """Issue ``call`` on ``group``; the returned function completes it (raising its error)."""
    data = buffer[: call.nbytes]
    deadline = Deadline.from_wire(call.timeout_s)
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
            reply = ChildReply(call_id, None)
        except Exception as exc:
            reply = ChildReply.failed(call_id, exc)
        try:
            conn.send(reply)
        except OSError:
            return
