"""Worker processes and states for refit-nccl's multi-process tests (imported by name)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from refit_core import RefitError, TensorSpec
from refit_core.backend import CollectiveSenderSpec, Deadline
from refit_lab.faults import ProcessGang, fault_self
from refit_lab.ray_cluster import free_port
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.child.process_group import ChildProcessGroup
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Backend
from refit_nccl.transfer.broadcast import receive_packed, send_packed
from refit_nccl.transfer.handshake import agree_on_plan
from refit_nccl.transfer.plan import TransferPlan

MiB = 1024 * 1024
SETUP_S = 30.0
"""Deadline of setup steps (rendezvous, handshake) on a loaded 2-core machine."""

Report = dict[str, Any]
Emit = Callable[[Report], None]


def mixed_state(seed: int, filler_bytes: int, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd sizes, non-contiguous views, tensors larger than a bucket, filler."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {
        "scalar.f32": torch.randn((), generator=g),
        "empty.bf16": torch.empty((0, 5), dtype=torch.bfloat16),
        "odd.u8": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "odd.bf16": torch.randn(37, 13, generator=g).to(torch.bfloat16),
        "mask.bool": torch.rand(11, generator=g) > 0.5,
        "idx.i64": torch.randint(-(2**40), 2**40, (5, 3), generator=g),
        "half.f16": torch.randn(3, 333, generator=g).to(torch.float16),
        "double.f64": torch.randn(17, generator=g, dtype=torch.float64),
        "transposed.f32": torch.randn(64, 48, generator=g).t(),
        "strided.bf16": torch.randn(50, 40, generator=g).to(torch.bfloat16)[::2, 1::3],
        "huge.f32": torch.randn(bucket_bytes // 4 + 1001, generator=g),
        "huge_transposed.bf16": torch.randn(bucket_bytes // 512 + 3, 256, generator=g)
        .to(torch.bfloat16)
        .t(),
        "after_huge.i8": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=g),
    }
    layer = 0
    while filler_bytes > 0:
        tensor = torch.randn(1024, 1024 + layer % 7, generator=g).to(torch.bfloat16)
        state[f"layers.{layer}.weight"] = tensor
        filler_bytes -= tensor.numel() * 2
        layer += 1
    return state


def info_of(state: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(t) for name, t in state.items()}


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def bitwise_differences(
    expected: dict[str, torch.Tensor], received: dict[str, torch.Tensor]
) -> list[str]:
    wrong = [
        name
        for name, tensor in expected.items()
        if name not in received
        or TensorSpec.of(received[name]) != TensorSpec.of(tensor)
        or not torch.equal(as_bytes(received[name]), as_bytes(tensor))
    ]
    return wrong + sorted(set(received) - set(expected))


def connect(
    rank: int,
    world: int,
    port: int,
    name: str = "test",
    backend: Backend = "gloo",
    join_timeout_s: float = SETUP_S,
    params: Report | None = None,
) -> AbortableProcessGroup:
    """Join a group on 127.0.0.1 (with NCCL, on GPU ``rank``); in a child process where
    ``params["child_ranks"]`` names this rank; ``params["join_timeout_s"]`` overrides
    ``join_timeout_s``; ``params["nccl_env"]`` is set in the environment first (``{rank}``
    in a value is this rank)."""
    for key, value in (params or {}).get("nccl_env", {}).items():
        os.environ[key] = value.format(rank=rank)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    spec = GroupSpec("127.0.0.1", port, rank, world, backend, name)
    params = params or {}
    group = (
        ChildProcessGroup(spec)
        if rank in params.get("child_ranks", ())
        else AbortableProcessGroup(spec)
    )
    group.connect(Deadline.after(params.get("join_timeout_s", join_timeout_s)))
    return group


def transfer(
    group: AbortableProcessGroup,
    state: dict[str, torch.Tensor],
    geometry: CollectiveSenderSpec,
    deadline: Deadline,
    on_bucket: Callable[[int], None] = lambda index: None,
) -> dict[str, torch.Tensor]:
    """Agree on the plan, then rank 0 sends ``state`` and the others receive it (returned)."""
    plan = TransferPlan.build(info_of(state), geometry)
    agree_on_plan(group, plan.digest, Deadline.after(SETUP_S))
    received: dict[str, torch.Tensor] = {}
    if group.rank == 0:
        send_packed(group, plan, state.items(), deadline)
        return received

    def consume(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            received[name] = tensor.to("cpu", copy=True)
        on_bucket(len(received))

    receive_packed(group, plan, consume, deadline)
    return received


def _error(exc: BaseException) -> Report:
    return {"error": type(exc).__name__, "message": str(exc)}


def scenario_broadcast(rank: int, world: int, ports: list[int], params: Report, emit: Emit) -> None:
    """Bitwise packed broadcast of the mixed state (or, with ``filler_only``, of bf16 filler)."""
    geometry = CollectiveSenderSpec(params["peer"], params["bucket_bytes"], params["num_buffers"])
    state = mixed_state(params["seed"], params["filler_bytes"], params["bucket_bytes"])
    if params.get("filler_only"):
        state = {name: t for name, t in state.items() if name.startswith("layers.")}
    group = connect(rank, world, ports[0], backend=params.get("backend", "gloo"), params=params)
    received = transfer(group, state, geometry, Deadline.after(SETUP_S))
    wrong = bitwise_differences(state, received) if rank else []
    group.abort("test done")
    emit({"event": "broadcast", "wrong": wrong})


def scenario_mismatch(rank: int, world: int, ports: list[int], params: Report, emit: Emit) -> None:
    """Each rank plans with its own bucket size and filler; report what the handshake said."""
    bucket = params["bucket_bytes_by_rank"][rank]
    state = mixed_state(0, params["filler_bytes_by_rank"][rank], MiB)
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", bucket, 2))
    group = connect(rank, world, ports[0])
    try:
        agree_on_plan(group, plan.digest, Deadline.after(SETUP_S))
        emit({"event": "handshake", "error": None})
    except RefitError as exc:
        emit({"event": "handshake", **_error(exc)})
    group.abort("test done")


def scenario_calls(rank: int, world: int, ports: list[int], params: Report, emit: Emit) -> None:
    """all_reduce, send/recv, barrier and broadcast; then abort twice and call after abort."""
    group = connect(rank, world, ports[0], params=params)
    deadline = Deadline.after(SETUP_S)
    total = torch.tensor([rank + 1.0])
    group.all_reduce(total, deadline)
    top = torch.tensor([float(rank)])
    group.all_reduce(top, deadline, op="max")
    ring = torch.full((3,), float(rank))
    if rank == 0:
        group.send(ring, 1, deadline)
    elif rank == 1:
        group.recv(ring, 0, deadline)
    group.barrier(deadline)
    payload = (
        torch.arange(10, dtype=torch.int32)
        if rank == world - 1
        else torch.zeros(10, dtype=torch.int32)
    )
    group.broadcast(payload, world - 1, deadline)
    group.abort("first abort")
    group.abort("second abort")
    emit(
        {
            "event": "calls",
            "sum": total.item(),
            "max": top.item(),
            "ring": ring.tolist(),
            "broadcast": payload.tolist(),
            "cause": group.abort_cause,
            "connected": group.connected,
        }
    )
    try:
        group.barrier(Deadline.after(5))
        emit({"event": "after_abort", "error": None})
    except RefitError as exc:
        emit({"event": "after_abort", **_error(exc)})


def _fault_setup(params: Report) -> tuple[CollectiveSenderSpec, dict[str, torch.Tensor]]:
    geometry = CollectiveSenderSpec("refit", params["bucket_bytes"], 2)
    return geometry, mixed_state(params["seed"], params["filler_bytes"], params["bucket_bytes"])


def _round(rank: int, world: int, port: int, name: str, params: Report) -> dict[str, torch.Tensor]:
    """Join a group (waiting up to ``join_timeout_s`` for its members) and run one transfer
    under a deadline of :data:`SETUP_S` from then."""
    geometry, state = _fault_setup(params)
    group = connect(rank, world, port, name, params["backend"], params["join_timeout_s"], params)
    try:
        return transfer(group, state, geometry, Deadline.after(SETUP_S))
    finally:
        group.abort(f"{name} done")


def scenario_survivor(rank: int, world: int, ports: list[int], params: Report, emit: Emit) -> None:
    """Ranks 0 and 1: for each fault, a transfer in which the last rank faults itself (see
    :func:`scenario_victim`), then a retry over the survivors; finally a transfer with a
    restarted receiver (see :func:`scenario_rejoin`) unless ``params["rejoin"]`` is False."""
    geometry, state = _fault_setup(params)
    for index, signal_name in enumerate(params["signals"]):
        group = connect(
            rank, world, ports[2 * index], f"fault-{signal_name}", params["backend"], params=params
        )
        deadline = Deadline.after(params["deadline_s"])
        try:
            transfer(group, state, geometry, deadline)
            emit({"event": f"{signal_name}:transfer", "error": None})
        except RefitError as exc:
            assert deadline.at is not None
            released = time.monotonic() - deadline.at
            emit({"event": f"{signal_name}:transfer", **_error(exc), "after_deadline_s": released})
        try:
            group.broadcast(torch.zeros(1), 0, Deadline.after(5))
            emit({"event": f"{signal_name}:after_abort", "error": None})
        except RefitError as exc:
            emit({"event": f"{signal_name}:after_abort", **_error(exc)})
        received = _round(rank, world - 1, ports[2 * index + 1], "survivors", params)
        emit(
            {
                "event": f"{signal_name}:retry",
                "wrong": bitwise_differences(state, received) if rank else [],
            }
        )
    if params.get("rejoin", True):
        received = _round(rank, world, ports[-1], "rejoined", params)
        emit({"event": "rejoin", "wrong": bitwise_differences(state, received) if rank else []})


def scenario_victim(rank: int, world: int, ports: list[int], params: Report, emit: Emit) -> None:
    """The last rank of fault round ``victim``: faults itself after its first bucket."""
    geometry, state = _fault_setup(params)
    index = params["victim"]
    signum = signal.Signals[params["signals"][index]]
    group = connect(
        rank,
        world,
        ports[2 * index],
        f"fault-{signum.name}",
        params["backend"],
        params["join_timeout_s"],
        params,
    )
    transfer(group, state, geometry, Deadline.after(SETUP_S), lambda _: fault_self(signum))
    emit({"event": "victim survived"})


def scenario_rejoin(rank: int, world: int, ports: list[int], params: Report, emit: Emit) -> None:
    """The restarted receiver: joins the last group of :func:`scenario_survivor`."""
    _, state = _fault_setup(params)
    received = _round(rank, world, ports[-1], "rejoined", params)
    emit({"event": "rejoin", "wrong": bitwise_differences(state, received)})


SCENARIOS: dict[str, Callable[[int, int, list[int], Report, Emit], None]] = {
    "broadcast": scenario_broadcast,
    "mismatch": scenario_mismatch,
    "calls": scenario_calls,
    "survivor": scenario_survivor,
    "victim": scenario_victim,
    "rejoin": scenario_rejoin,
}


def _put(results: Any, rank: int, scenario: str, step: Any, report: Report) -> None:
    results.put({"rank": rank, "scenario": scenario, "step": step, **report})


def run(results: Any, rank: int, world: int, steps: list[tuple[str, Report]]) -> None:
    """Process entry point: run each ``(scenario, params)`` in turn; put every report, tagged
    with the rank and scenario. A failed scenario is reported and the next one still runs."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    for scenario, params in steps:
        emit = functools.partial(_put, results, rank, scenario, params.get("step"))
        try:
            SCENARIOS[scenario](rank, world, params["ports"], params, emit)
        except Exception as exc:
            emit({"event": "crash", **_error(exc)})


def launch(
    gang: ProcessGang, ranks: range | list[int], world: int, steps: list[tuple[str, Report]]
) -> None:
    """Start the ``steps`` on each of ``ranks`` (parent side)."""
    for rank in ranks:
        gang.spawn(run, gang.results, rank, world, steps)


def by_event(reports: list[Report], scenario: str, event: str) -> dict[int, Report]:
    """Rank -> report of ``event`` in ``scenario``; fails on a crash report of the scenario."""
    mine = [r for r in reports if r["scenario"] == scenario]
    crashes = [r for r in mine if r["event"] == "crash"]
    assert not crashes, f"{scenario}: workers crashed: {crashes}"
    return {r["rank"]: r for r in mine if r["event"] == event}


# -- the shared gloo session (see conftest.py) ---------------------------------------------

WORLD = 3
"""Ranks of the collective steps."""

STEPS: list[tuple[str, dict[str, Any]]] = [
    ("calls", {}),
    (
        "broadcast",
        {
            "peer": "refit",
            "bucket_bytes": MiB,
            "num_buffers": 2,
            "seed": 1,
            "filler_bytes": 3 * MiB,
        },
    ),
    (
        "broadcast",
        {"peer": "refit", "bucket_bytes": 2 * MiB, "num_buffers": 3, "seed": 2, "filler_bytes": 0},
    ),
    (
        "broadcast",
        {
            "peer": "vllm",
            "bucket_bytes": MiB,
            "num_buffers": 2,
            "seed": 3,
            "filler_bytes": 4 * MiB,
            "filler_only": True,
        },
    ),
    ("mismatch", {"bucket_bytes_by_rank": [MiB, MiB, 2 * MiB], "filler_bytes_by_rank": [0, 0, 0]}),
    ("mismatch", {"bucket_bytes_by_rank": [MiB] * 3, "filler_bytes_by_rank": [MiB, 0, MiB]}),
    ("mismatch", {"bucket_bytes_by_rank": [MiB] * 3, "filler_bytes_by_rank": [MiB] * 3}),
]


DEADLINE_S = 2.0
RELEASE_SLACK_S = 1.0
SIGNALS = ["SIGKILL", "SIGSTOP"]
FAULT_PARAMS: Report = {
    "bucket_bytes": 8 * MiB,
    "filler_bytes": 60 * MiB,
    "seed": 5,
    "deadline_s": DEADLINE_S,
    "signals": SIGNALS,
    "join_timeout_s": 120.0,
    "backend": "gloo",
}


def launch_session(gang: ProcessGang) -> int:
    """Start the shared gloo workers; returns how many reports they will put.

    Ranks 0 and 1 run every collective step, then survive both faults; the first rank 2 runs
    the collective steps, then is the SIGKILL victim; fresh processes are the SIGSTOP victim
    and the restarted receiver that rejoins at the end.
    """
    steps = [
        (name, {**params, "ports": [free_port()], "step": i})
        for i, (name, params) in enumerate(STEPS)
    ]
    faults = {**FAULT_PARAMS, "ports": [free_port() for _ in range(2 * len(SIGNALS) + 1)]}
    launch(gang, [0, 1], WORLD, [*steps, ("survivor", faults)])
    launch(gang, [2], WORLD, [*steps, ("victim", {**faults, "victim": 0})])
    for victim in range(1, len(SIGNALS)):
        launch(gang, [2], WORLD, [("victim", {**faults, "victim": victim})])
    launch(gang, [2], WORLD, [("rejoin", faults)])
    collective_reports = sum(2 if name == "calls" else 1 for name, _ in STEPS) * WORLD
    # per survivor: transfer, after_abort and retry per fault, then rejoin; the rejoiner: rejoin
    return collective_reports + 2 * (3 * len(SIGNALS) + 1) + 1


# -- the child-process communicator session (test_child.py) ---------------------------------

CHILD_JOIN_S = 240.0
"""How long a member of a group with child communicators waits for the others to join."""
CHILD_RANKS = [0, 1]
"""Ranks whose communicator runs in a child process; rank 2 (the victim) runs in process, so
its SIGSTOP freezes its communicator too."""


def launch_child_session(gang: ProcessGang) -> int:
    """Start the child-communicator workers; returns how many reports they will put.

    Ranks 0 and 1 run their communicators in child processes: the calls, a bitwise
    broadcast, then they survive a SIGSTOP of rank 2 (in process) mid-transfer and retry
    over themselves (fresh children).
    """
    # starting a child costs a torch import: tens of seconds on a loaded 2-core machine
    child = {"child_ranks": CHILD_RANKS, "join_timeout_s": CHILD_JOIN_S}
    steps: list[tuple[str, Report]] = [
        ("calls", {**child, "ports": [free_port()], "step": 0}),
        ("broadcast", {**STEPS[1][1], **child, "ports": [free_port()], "step": 1}),
    ]
    faults = {
        **FAULT_PARAMS,
        **child,
        "signals": ["SIGSTOP"],
        "rejoin": False,
        "ports": [free_port() for _ in range(2)],
    }
    launch(gang, CHILD_RANKS, WORLD, [*steps, ("survivor", faults)])
    launch(gang, [2], WORLD, [*steps, ("victim", {**faults, "victim": 0})])
    # calls: 2 reports per rank; broadcast: 1; per survivor: transfer, after_abort, retry
    return 3 * WORLD + 2 * 3
