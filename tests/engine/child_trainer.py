"""The trainer side of the engine tier's failure tests, in a process of its own, so a test can
kill it or freeze it mid-transfer.

:class:`ChildParticipant` spawns a process that builds an endpoint (refit-nccl's
``TrainerEndpoint``, refit-zmq's ``ShardProducer``, or an IPC trainer running refit-zmq's own
``IpcWeightSynchronizer``) and serves its methods over a pipe, each call on a thread of its own
(an abort must reach an endpoint while a transfer runs). The trainer's weights come from
checkpoints on disk; its source faults its own process (SIGKILL or SIGSTOP, through
``refit_lab.faults.fault_self``) right before handing out a given tensor, counted over every
pass, so "in the middle of a transfer" is exact.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch

from refit_core import NamedTensor, StateDictInfo, WorkerError
from refit_core.backend import Participant
from refit_core.sources import StateDictSource

SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}


def _load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


class FaultingSource:
    """The checkpoints ``paths`` in turn (pass ``i`` reads ``paths[i]``, the last one after
    that); with ``fault``, the process signals itself before tensor ``after`` (counted over
    every pass)."""

    def __init__(self, paths: Sequence[str], fault: str | None, after: int) -> None:
        self._paths = list(paths)
        self._fault = fault
        self._after = after
        self._passes = 0
        self._handed = 0

    def _source(self, path: str) -> StateDictSource:
        return StateDictSource(_load(path), dtype="bfloat16")

    def state_dict_info(self) -> StateDictInfo:
        return self._source(self._paths[0]).state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        path = self._paths[min(self._passes, len(self._paths) - 1)]
        self._passes += 1
        for named in self._source(path).iter_tensors():
            if self._fault is not None and self._handed == self._after:
                from refit_lab.faults import fault_self

                fault_self(SIGNALS[self._fault])
            self._handed += 1
            yield named


class FaultingPolicy:
    """A ``PolicyLike`` over one :class:`FaultingSource`."""

    def __init__(self, paths: Sequence[str], fault: str | None = None, after: int = 0) -> None:
        self._source = FaultingSource(paths, fault, after)

    def weight_source(self) -> FaultingSource:
        return self._source


def collective_trainer(paths: Sequence[str], fault: str | None, after: int) -> Any:
    """Trainer rank 0 of a collective refit."""
    from refit_nccl import TrainerEndpoint

    return TrainerEndpoint(FaultingPolicy(paths, fault, after))


def sparse_producer(paths: Sequence[str], fault: str | None, after: int) -> Any:
    """The one producer shard of a sparse refit."""
    from refit_zmq.relay import ShardProducer

    return ShardProducer(FaultingPolicy(paths, fault, after))


class IpcTrainer:
    """A colocated trainer: refit-zmq's IPC synchronizer over the given receivers (the parent,
    which owns the engines, opens and closes their update sessions)."""

    def __init__(
        self,
        paths: Sequence[str],
        fault: str | None,
        after: int,
        addresses: Sequence[str],
        timeout_s: float,
        buffer_size_bytes: int,
        corrupt_bucket: int | None,
    ) -> None:
        from refit_zmq.ipc import IpcOptions, IpcWeightSynchronizer

        if corrupt_bucket is not None:
            _corrupt_bucket_message(corrupt_bucket)
        self._synchronizer = IpcWeightSynchronizer(
            FaultingPolicy(paths, fault, after),
            lambda: list(addresses),
            refit_timeout_s=timeout_s,
            options=IpcOptions(buffer_size_bytes=buffer_size_bytes, device="cpu"),
        )

    def refit_ready(self) -> bool:
        """Answered once the process has started (imports done)."""
        return True

    def refit_sync(self, version: int) -> int:
        return self._synchronizer.sync_weights(version).version


def ipc_trainer(paths: Sequence[str], fault: str | None, after: int, *rest: Any) -> IpcTrainer:
    return IpcTrainer(paths, fault, after, *rest)


def _corrupt_bucket_message(nth: int) -> None:
    """Make the ``nth`` bucket message this process sends name a tensor that does not exist
    (the receivers refuse it after loading the buckets before it)."""
    from refit_zmq.ipc import WorkerLinks

    send = WorkerLinks.send
    seen = [0]

    def corrupting(self: Any, message: Any, deadline: Any) -> None:
        if message.get("op") == "bucket":
            seen[0] += 1
            if seen[0] == nth:
                items = [list(item) for item in message["items"]]
                items[0][0] = "model.layers.0.not_a_tensor.weight"
                message = {**message, "items": items}
        send(self, message, deadline)

    WorkerLinks.send = corrupting  # type: ignore[method-assign]


def _serve(connection: Connection, factory: Any, args: tuple[Any, ...]) -> None:
    endpoint = factory(*args)
    lock = threading.Lock()

    def run(call_id: int, method: str, call_args: tuple[Any, ...]) -> None:
        try:
            reply: tuple[Any, ...] = (call_id, True, getattr(endpoint, method)(*call_args))
        except BaseException as exc:
            reply = (call_id, False, exc)
        with lock:
            connection.send(reply)

    while True:
        try:
            call_id, method, call_args = connection.recv()
        except EOFError:
            return
        threading.Thread(target=run, args=(call_id, method, call_args), daemon=True).start()


class ChildParticipant(Participant[Any]):
    """An endpoint ``factory(*args)`` in a spawned process; a call fails with WorkerError once
    the process is gone."""

    def __init__(self, label: str, factory: Any, *args: Any) -> None:
        import multiprocessing

        super().__init__(label)
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, factory, args), daemon=True)
        self.process.start()
        child.close()
        self._futures: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def key(self) -> Hashable:
        return self.process.pid

    def _start(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Future[Any]:
        if kwargs:
            raise TypeError(f"{method}: calls to a child process take positional arguments")
        future: Future[Any] = Future()
        with self._lock:
            self._next += 1
            self._futures[self._next] = future
            try:
                self._connection.send((self._next, method, args))
            except OSError as exc:
                del self._futures[self._next]
                future.set_exception(self._gone(method, exc))
        return future

    def _gone(self, method: str, cause: BaseException) -> WorkerError:
        return WorkerError(
            f"the trainer process is gone ({cause})", worker=self.label, operation=method
        )

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._connection.recv()
            except (EOFError, OSError) as exc:
                with self._lock:
                    pending, self._futures = self._futures, {}
                for future in pending.values():
                    future.set_exception(self._gone("call", exc))
                return
            with self._lock:
                future = self._futures.pop(call_id)
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def close(self) -> None:
        """Kill the process (thawed first, in case it froze itself) and reap it."""
        from refit_lab.faults import kill, thaw

        if self.process.pid is not None and self.process.is_alive():
            thaw(self.process.pid)
            kill(self.process.pid)
        self.process.join(30)
        self._connection.close()
