"""The ceiling of any two-copy channel on this machine: a bare pipelined copy between processes.

A colocated CPU channel copies every byte twice: the trainer's tensor into shared memory, and
shared memory into the engine's parameters. :class:`CopyPipeline` does exactly that work and
nothing else, with the IPC channel's layout (two ping-pong buffers of the same size, slots
aligned alike) and threads (one side per process, half the threads each): the trainer side
fills one buffer while the engine side empties the other, told which buffer and slots by a
pickled tuple over a pipe. No control protocol, no checks, no transaction: what it reaches is
what any channel that copies twice could reach here, measured in the same run as the channel.
"""

from __future__ import annotations

import multiprocessing.connection
from collections.abc import Sequence

import torch
import torch.multiprocessing

from refit_lab.bench.runtime import ChildGroup, Deadline
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig

__all__ = ["CopyPipeline", "plan_buckets"]

ALIGN_BYTES = 256
"""Slot alignment, as the IPC channel's (``refit_zmq.ipc.sizing.ALIGN_BYTES``)."""

Slot = tuple[int, int, int]
"""(tensor index, offset in the buffer, bytes)."""


def plan_buckets(sizes: Sequence[int], buffer_bytes: int) -> list[list[Slot]]:
    """Buckets of aligned slots in order, a new bucket when the next tensor does not fit.

    Raises:
        ValueError: a tensor larger than a buffer (the channel gives those a one-off buffer;
            the bench's states have none).
    """
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    offset = 0
    for index, nbytes in enumerate(sizes):
        if nbytes > buffer_bytes:
            raise ValueError(
                f"tensor {index} ({nbytes} bytes) exceeds a {buffer_bytes}-byte buffer"
            )
        if current and offset + nbytes > buffer_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append((index, offset, nbytes))
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    if current:
        buckets.append(current)
    return buckets


def _recv(conn: multiprocessing.connection.Connection, deadline: Deadline) -> object:
    if not conn.poll(deadline.remaining_s()):
        deadline.check()
        raise TimeoutError(f"{deadline.what}: no message from the other side")
    return conn.recv()


def _empty_buffers(
    conn: multiprocessing.connection.Connection,
    config: ReferenceModelConfig,
    names: list[str],
    buffers: list[torch.Tensor],
    threads: int,
    timeout_s: float,
) -> dict[str, int]:
    """Child: copy each announced bucket out of its buffer into a reference engine's
    parameters, acknowledge it, until told to stop; the engine's final digests."""
    torch.set_num_threads(threads)
    engine = ReferenceEngine(config)
    params = engine.checkpoint_tensors()
    targets = [params[name].reshape(-1).view(torch.uint8) for name in names]
    deadline = Deadline(timeout_s, "copy pipeline (engine side)")
    conn.send("ready")
    while (message := _recv(conn, deadline)) is not None:
        assert isinstance(message, tuple)
        buffer, slots = message
        memory = buffers[buffer]
        for index, offset, nbytes in slots:
            targets[index].copy_(memory[offset : offset + nbytes])
        conn.send(buffer)
    return engine.state_digests()


class CopyPipeline:
    """The trainer side of the bare two-copy pipeline, its engine side in a child process.

    Args:
        config: the engine side's reference model (its parameters are the destination).
        state: the trainer's tensors, checkpoint names as the engine's.
        buffer_bytes: each of the two buffers.
        threads: torch threads of each side.
        deadline: bounds every wait and the child's life.
    """

    def __init__(
        self,
        config: ReferenceModelConfig,
        state: dict[str, torch.Tensor],
        *,
        buffer_bytes: int,
        threads: int,
        deadline: Deadline,
    ) -> None:
        self._sources = [t.detach().reshape(-1).view(torch.uint8) for t in state.values()]
        self._plan = plan_buckets([s.numel() for s in self._sources], buffer_bytes)
        self._buffers = [
            torch.zeros(buffer_bytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
            for _ in range(2)
        ]
        self._deadline = deadline
        self._conn, child_conn = multiprocessing.Pipe()
        args = (child_conn, config, list(state), self._buffers, threads, deadline.remaining_s())
        self._child = ChildGroup(_empty_buffers, [args], deadline=deadline, name="copy-pipeline")

    def __enter__(self) -> CopyPipeline:
        self._child.__enter__()
        _recv(self._conn, self._deadline)
        return self

    def run(self) -> None:
        """One pass of every byte: fill a buffer while the other side empties the other."""
        in_flight = 0
        for number, slots in enumerate(self._plan):
            buffer = number % 2
            if in_flight == 2:
                _recv(self._conn, self._deadline)
                in_flight -= 1
            memory = self._buffers[buffer]
            for index, offset, nbytes in slots:
                memory[offset : offset + nbytes].copy_(self._sources[index])
            self._conn.send((buffer, slots))
            in_flight += 1
        for _ in range(in_flight):
            _recv(self._conn, self._deadline)

    def digests(self) -> dict[str, int]:
        """Stop the engine side; its engine's digests."""
        self._conn.send(None)
        (result,) = self._child.results()
        return result

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._child.__exit__(kind, exc, tb)
        self._conn.close()
