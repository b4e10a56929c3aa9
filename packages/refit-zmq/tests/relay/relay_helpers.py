"""Helpers of the relay tests: seeded states, relays in child processes, a test producer.

Relays run in forkserver children (torch preloaded, as the bench harness does): spawning
seven fresh interpreters that each import torch takes minutes on a loaded 2-core machine.
Every child is killed when its fleet closes, whatever happened.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core import WeightVersion
from refit_core.backend import Deadline, LocalParticipant
from refit_core.sources import StateDictSource
from refit_lab.faults import fault_self, stop_process
from refit_zmq.codec import tensor_digest
from refit_zmq.relay import (
    AbortReply,
    CommitReply,
    CurveConfig,
    PayloadSink,
    RelayCoordinator,
    RelayStatus,
    RelayTuning,
    ShardProducer,
    TensorReceiver,
    TransferOptions,
    TransferResult,
    ZmqSparseRefitServer,
    run_transfer,
)
from refit_zmq.tracker import TrackerConfig

KEY_VAR = "REFIT_TEST_RELAY_KEY"
KEY = "relay-test-key-7f3a"
KiB = 1 << 10
MiB = 1 << 20
TUNING = RelayTuning(chunk_bytes=64 * KiB, max_inflight_bytes=16 * MiB, retries=1)
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed.weight": ((512, 256), torch.bfloat16),
    "layers.0.qkv.weight": ((768, 256), torch.bfloat16),
    "layers.0.mlp.weight": ((1024, 256), torch.bfloat16),
    "layers.0.norm.weight": ((256,), torch.float32),
    "lm_head.weight": ((512, 256), torch.bfloat16),
}

State = dict[str, torch.Tensor]


def make_state(seed: int) -> State:
    """A deterministic random state of :data:`SHAPES`."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, (shape, dtype) in SHAPES.items()
    }


def step_state(state: State, seed: int, density: float = 0.01) -> State:
    """A copy of ``state`` with about ``density`` of every tensor's elements redrawn."""
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in state.items():
        changed = tensor.clone()
        flat = changed.view(-1)
        hit = torch.rand(flat.numel(), generator=generator) < density
        flat[hit] = torch.randn(int(hit.sum()), generator=generator).to(tensor.dtype)
        new[name] = changed
    return new


def digests(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Per-tensor bitwise digests."""
    return {name: tensor_digest(tensor) for name, tensor in state.items()}


@dataclass(frozen=True)
class RelaySpec:
    """One relay child: the state and version its receiver starts with, and its settings."""

    seed: int = 0
    version: int | None = 0
    api_key: str | None = None
    timeout_s: float = 15.0
    tuning: RelayTuning = TUNING
    curve_public: bytes | None = None
    curve_secret: bytes | None = None
    apply_delay_s: float = 0.0
    die_at: tuple[int, int] | None = None
    fail_once: tuple[str, ...] = ()


class FaultyReceiver(TensorReceiver):
    """A receiver that takes ``delay_s`` per payload, SIGKILLs its own process while applying
    payload ``die_at[1]`` of the ``die_at[0]``-th transfer it sees (from 1), and fails the
    first call of each method named in ``fail_once`` ("commit", "rollback")."""

    def __init__(self, state: State, spec: RelaySpec) -> None:
        super().__init__(state, version=spec.version)
        self._delay_s = spec.apply_delay_s
        self._die_at = spec.die_at
        self._fail_once = set(spec.fail_once)
        self._transfers: list[str] = []
        self._applies = 0

    def _maybe_fail(self, method: str) -> None:
        if method in self._fail_once:
            self._fail_once.discard(method)
            raise RuntimeError(f"injected {method} failure")

    def commit(self, transfer_id: str) -> CommitReply:
        self._maybe_fail("commit")
        return super().commit(transfer_id)

    def rollback(self, transfer_id: str) -> AbortReply:
        self._maybe_fail("rollback")
        return super().rollback(transfer_id)

    def open_payload(self, metadata: Mapping[str, Any]) -> PayloadSink:
        transfer_id = str(metadata["transfer_id"])
        if transfer_id not in self._transfers:
            self._transfers.append(transfer_id)
            self._applies = 0
        self._applies += 1
        if (len(self._transfers), self._applies) == self._die_at:
            fault_self(signal.SIGKILL)
        time.sleep(self._delay_s)
        return super().open_payload(metadata)


def serve_relay(conn: multiprocessing.connection.Connection, spec: RelaySpec) -> None:
    """Child main: one relay over ``make_state(spec.seed)``; reports (address, pid), then serves
    until the parent says stop or goes away."""
    torch.set_num_threads(1)
    if spec.api_key is not None:
        os.environ[KEY_VAR] = spec.api_key
    receiver = FaultyReceiver(make_state(spec.seed), spec)
    curve = None
    if spec.curve_public is not None:
        curve = CurveConfig(spec.curve_public, spec.curve_secret)
    server = ZmqSparseRefitServer(
        receiver,
        api_key_env_var=KEY_VAR if spec.api_key is not None else None,
        timeout_s=spec.timeout_s,
        tuning=spec.tuning,
        curve=curve,
    )
    conn.send((server.start(), os.getpid()))
    with contextlib.suppress(EOFError):
        conn.recv()
    server.close()


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        preload = ["torch", "zmq", "refit_zmq.relay", "refit_zmq.relay_cli", "relay_helpers"]
        context.set_forkserver_preload(preload)
        return context
    return multiprocessing.get_context("spawn")


class _Announcer(io.TextIOBase):
    """A relay process's stdout: its announcement line goes to the parent over a pipe."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn
        self._line = ""

    def write(self, text: str) -> int:
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            self._conn.send(line)
        return len(text)


def launch_relay(argv: list[str], conn: multiprocessing.connection.Connection) -> None:
    """Child main: ``python -m refit_zmq.relay`` with ``argv``, its stdout sent to the
    parent (the process was forked from a server with torch loaded: no interpreter start)."""
    from refit_zmq.relay_cli import main

    sys.stdout = _Announcer(conn)
    sys.exit(main(argv))


@dataclass
class LaunchedRelay:
    """One relay process started by the launcher."""

    process: multiprocessing.process.BaseProcess
    address: str
    pid: int
    stopped: bool = False

    @property
    def alive(self) -> bool:
        """Running (or frozen), not dead."""
        return self.process.is_alive()

    def signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` (SIGKILL, SIGSTOP, SIGCONT) to the relay."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)
        if signum == signal.SIGSTOP:
            self.stopped = True
        elif signum in (signal.SIGCONT, signal.SIGKILL):
            self.stopped = False
        if signum == signal.SIGKILL:
            self.process.join(10)

    def close(self) -> None:
        """End the relay, whatever state it is in."""
        self.signal(signal.SIGKILL)


def start_launched(argv: list[str], *, start_timeout_s: float = 120.0) -> LaunchedRelay:
    """A relay process: the launcher with ``argv`` (``["serve", ...]``), once it listens."""
    context = _context()
    parent, child = context.Pipe()
    process = context.Process(  # type: ignore[attr-defined]
        target=launch_relay, args=(argv, child), name="launched-relay", daemon=True
    )
    process.start()
    child.close()
    try:
        if not parent.poll(start_timeout_s):
            raise TimeoutError("the launched relay did not announce itself")
        announced = json.loads(parent.recv())
    except BaseException:
        process.kill()
        raise
    finally:
        parent.close()
    return LaunchedRelay(process, announced["address"], announced["pid"])


class RelayFleet:
    """Relays in child processes; use as a context manager (every child is reaped on exit)."""

    def __init__(self, specs: list[RelaySpec], *, start_timeout_s: float = 120.0) -> None:
        self.specs = specs
        self._start_timeout_s = start_timeout_s
        self.addresses: list[str] = []
        self.pids: list[int] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []

    def __enter__(self) -> RelayFleet:
        context = _context()
        try:
            for index, spec in enumerate(self.specs):
                parent, child = context.Pipe()
                process = context.Process(  # type: ignore[attr-defined]
                    target=serve_relay, args=(child, spec), name=f"relay-{index}", daemon=True
                )
                process.start()
                child.close()
                self._processes.append(process)
                self._conns.append(parent)
            end = time.monotonic() + self._start_timeout_s
            for conn, process in zip(self._conns, self._processes, strict=True):
                if not conn.poll(max(0.0, end - time.monotonic())):
                    raise TimeoutError(f"{process.name} did not start")
                address, pid = conn.recv()
                self.addresses.append(address)
                self.pids.append(pid)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The relay processes, in relay order."""
        return list(self._processes)

    def kill(self, index: int) -> None:
        """SIGKILL relay ``index`` and wait for it."""
        os.kill(self.pids[index], signal.SIGKILL)
        self._processes[index].join(10)

    def rss_bytes(self, index: int, field: str = "VmRSS") -> int:
        """Resident memory of relay ``index`` (``VmHWM``: its peak)."""
        with open(f"/proc/{self.pids[index]}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} for relay {index}")

    def close(self) -> None:
        """Stop every child (politely, then by signal) and join it."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send("stop")
        for process in self._processes:
            stop_process(process, 3.0, wait_s=5.0)
        for conn in self._conns:
            conn.close()


@dataclass
class Trainer:
    """Producer shards over one evolving state, with their trackers' versions in step."""

    state: State
    version: int
    shard_count: int = 1
    bucket_bytes: int = 256 * KiB
    shards: list[ShardProducer] = field(default_factory=list)

    def __post_init__(self) -> None:
        for rank in range(self.shard_count):
            config = TrackerConfig(
                shard_rank=rank,
                shard_count=self.shard_count,
                bucket_size_bytes=self.bucket_bytes,
                max_item_bytes=self.bucket_bytes // 2,
                threads=1,
            )
            producer = ShardProducer(self)
            producer.refit_init(config)
            producer.tracker.load_baseline(self.state, WeightVersion(self.version))
            self.shards.append(producer)
        self.participants = [
            LocalParticipant(producer, f"producer {rank}")
            for rank, producer in enumerate(self.shards)
        ]

    def weight_source(self) -> StateDictSource:
        """The current state (what the producers stream)."""
        return StateDictSource(self.state)

    def step(self, seed: int, density: float = 0.01) -> None:
        """Move the trainer's state on (not its version: that moves on commit)."""
        self.state = step_state(self.state, seed, density)

    def transfer(
        self,
        coordinator: RelayCoordinator,
        *,
        resync: bool = False,
        api_key_env_var: str | None = None,
        timeout_s: float = 15.0,
        curve: CurveConfig | None = None,
    ) -> TransferResult:
        """Send the state as version ``version + 1``; on commit the version moves on."""
        options = TransferOptions(api_key_env_var, timeout_s, TUNING, curve, 32)
        result = run_transfer(
            coordinator,
            self.participants,
            target_version=self.version + 1,
            resync=resync,
            options=options,
            expected_digests=digests(self.state),
            deadline=Deadline.never(),
        )
        self.version += 1
        return result

    def close(self) -> None:
        for producer, participant in zip(self.shards, self.participants, strict=True):
            producer.refit_close()
            participant.close()


def fresh_trainer(
    coordinator: RelayCoordinator, seed: int, *, shard_count: int = 1, **transfer: Any
) -> Trainer:
    """A trainer on ``make_state(seed)``; every relay is first brought to it by a dense resync."""
    versions = [
        status.version
        for status in coordinator.close_open_transfers(deadline=Deadline.never()).values()
        if isinstance(status, RelayStatus) and status.version is not None
    ]
    trainer = Trainer(make_state(seed), max(versions, default=0), shard_count)
    trainer.transfer(coordinator, resync=True, **transfer)
    return trainer


def held_digests(coordinator: RelayCoordinator) -> dict[str, dict[str, int] | None]:
    """Relay -> the digests it holds (None for a relay that did not answer)."""
    return {
        address: dict(status.digests or {}) if isinstance(status, RelayStatus) else None
        for address, status in coordinator.status(digests=True, deadline=Deadline.never()).items()
    }
