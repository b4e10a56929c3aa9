"""Packed broadcast error paths and variants, with ranks as threads of this process (fast).

The multi-process bitwise and fault tests are in ``test_collectives.py`` and
``test_faults.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from nccl_workers import MiB, bitwise_differences, info_of, mixed_state
from refit_core import ProtocolError, RefitTimeoutError
from refit_core.backend import CollectiveSenderSpec, Deadline
from refit_lab.ray_cluster import free_port
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.spec import GroupSpec
from refit_nccl.transfer.broadcast import receive_packed, send_packed
from refit_nccl.transfer.plan import TransferPlan
from refit_nccl.transfer.storage import PlanStorage, StagingBuffers

RankFn = Callable[[AbortableProcessGroup], Any]


def run_ranks(*fns: RankFn) -> list[Any]:
    """Run ``fns[r]`` as rank r of a fresh gloo group, each on its own thread; returns each
    result or the exception it raised."""
    port = free_port()

    def rank_main(rank: int) -> Any:
        group = AbortableProcessGroup(GroupSpec("127.0.0.1", port, rank, len(fns), name="threads"))
        try:
            group.connect(Deadline.after(30))
            return fns[rank](group)
        except Exception as exc:
            return exc
        finally:
            group.abort("test done")

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(rank_main, range(len(fns))))


def receiver(plan: TransferPlan, deadline: Deadline, into: dict[str, torch.Tensor]) -> RankFn:
    def consume(items: list[tuple[str, torch.Tensor]]) -> None:
        into.update((name, tensor.clone()) for name, tensor in items)

    return lambda group: receive_packed(group, plan, consume, deadline)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_buffers", [1, 4])
def test_bitwise_with_any_pipelining_depth_and_reused_staging(num_buffers: int) -> None:
    state = mixed_state(seed=21, filler_bytes=3 * MiB, bucket_bytes=MiB)
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", MiB, num_buffers))
    staging = StagingBuffers()
    for _ in range(2):
        received: dict[str, torch.Tensor] = {}
        sent, _ = run_ranks(
            lambda g: send_packed(g, plan, state.items(), Deadline.never(), staging=staging),
            receiver(plan, Deadline.never(), received),
        )
        assert bitwise_differences(state, received) == []
        assert sent.buckets == len(plan.buckets) and sent.dense_bytes == plan.dense_bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("source", "match"),
    [
        (lambda s: list(s.items())[:-1], "ended before"),
        (lambda s: [*s.items(), ("extra", torch.zeros(1))], "more than the plan"),
        (
            lambda s: [(n, t.double()) if n == "odd.bf16" else (n, t) for n, t in s.items()],
            "plan expects",
        ),
    ],
    ids=["short", "long", "wrong-dtype"],
)
def test_source_that_breaks_the_plan_fails_the_sender_and_releases_the_receiver(
    source: Callable[[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]], match: str
) -> None:
    state = mixed_state(seed=22, filler_bytes=2 * MiB, bucket_bytes=MiB)
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", MiB, 2))
    deadline = Deadline.after(2.0)
    sent, received = run_ranks(
        lambda g: send_packed(g, plan, source(state), deadline),
        receiver(plan, deadline, {}),
    )
    assert isinstance(sent, ProtocolError) and match in str(sent)
    if match != "more than the plan":  # a longer source is only noticed after the last bucket
        assert isinstance(received, RefitTimeoutError)
    assert deadline.at is not None and time.monotonic() <= deadline.at + 1.0


@pytest.mark.timeout(60)
def test_consumer_error_aborts_the_receiver_and_the_sender_ends_by_its_deadline() -> None:
    state = mixed_state(seed=23, filler_bytes=4 * MiB, bucket_bytes=MiB)
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", MiB, 2))
    deadline = Deadline.after(2.0)

    def failing(items: list[tuple[str, torch.Tensor]]) -> None:
        raise KeyError("engine refused a tensor")

    sent, received = run_ranks(
        lambda g: send_packed(g, plan, state.items(), deadline),
        lambda g: receive_packed(g, plan, failing, deadline),
    )
    assert isinstance(received, KeyError)
    assert isinstance(sent, RefitTimeoutError) or sent.buckets == len(plan.buckets)
    assert deadline.at is not None and time.monotonic() <= deadline.at + 1.0


@pytest.mark.timeout(60)
def test_receiving_into_plan_storage_lands_every_bucket_in_place() -> None:
    state = mixed_state(seed=24, filler_bytes=3 * MiB, bucket_bytes=MiB)
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", MiB, 2))
    storage = PlanStorage(plan, torch.device("cpu"))
    handed: list[str] = []

    def note(items: list[tuple[str, torch.Tensor]]) -> None:
        handed.extend(name for name, _ in items)

    run_ranks(
        lambda g: send_packed(g, plan, state.items(), Deadline.after(30)),
        lambda g: receive_packed(g, plan, note, Deadline.after(30), into=storage),
    )
    assert handed == list(state)
    assert bitwise_differences(state, storage.tensors()) == []


def test_storage_of_another_plan_is_refused() -> None:
    state = mixed_state(seed=25, filler_bytes=0, bucket_bytes=MiB)
    plan = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", MiB, 2))
    other = TransferPlan.build(info_of(state), CollectiveSenderSpec("refit", 2 * MiB, 2))
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1))
    with pytest.raises(ValueError, match="another plan"):
        receive_packed(
            group,
            plan,
            lambda _: None,
            Deadline.after(5),
            into=PlanStorage(other, torch.device("cpu")),
        )
