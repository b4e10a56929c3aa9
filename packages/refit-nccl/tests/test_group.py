"""The abortable process group: abort semantics, rendezvous deadline, argument checks.

Multi-process calls (all_reduce, send/recv, barrier, broadcast, abort twice, call after
abort) run in ``test_collectives.py``'s shared worker processes.
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from refit_core import BackendNotInstalledError, RefitAbortedError, RefitError, RefitTimeoutError
from refit_core.backend import Deadline
from refit_lab.ray_cluster import free_port
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.rendezvous import convention_of
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import traits_for, traits_of


def test_abort_of_a_never_connected_group() -> None:
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 2))
    group.abort("never connected")
    group.abort("again")
    assert group.aborted and group.abort_cause == "never connected"
    assert not group.connected
    with pytest.raises(RefitAbortedError, match="never connected"):
        group.connect(Deadline.after(5))


def test_call_before_connect_is_refused() -> None:
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1))
    with pytest.raises(RuntimeError, match="before connect"):
        group.broadcast(torch.zeros(1), 0, Deadline.after(5))


@pytest.mark.timeout(30)
def test_rendezvous_without_peers_ends_by_its_deadline() -> None:
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 2))
    with pytest.raises(RefitTimeoutError, match="rendezvous"):
        group.connect(Deadline.after(1.0))
    assert group.aborted
    with pytest.raises(RefitAbortedError):
        group.connect(Deadline.after(1.0))


@pytest.mark.timeout(30)
def test_single_rank_group_calls_and_argument_checks() -> None:
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1))
    group.connect(Deadline.after(10))
    assert group.connected
    data = torch.arange(4.0)
    group.broadcast(data, 0, Deadline.after(5))
    group.all_reduce(data, Deadline.after(5), op="max")
    group.barrier(Deadline.after(5))
    assert data.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="contiguous"):
        group.broadcast(torch.zeros(4, 4).t(), 0, Deadline.after(5))
    with pytest.raises(ValueError, match="not in a world"):
        group.broadcast(data, 3, Deadline.after(5))
    group.abort("done")
    with pytest.raises(RefitError, match="done"):
        group.all_reduce(data, Deadline.after(5))


@pytest.mark.timeout(30)
def test_expired_deadline_aborts_the_group() -> None:
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1))
    group.connect(Deadline.after(10))
    expired = Deadline(0.0)
    with pytest.raises(RefitTimeoutError, match="deadline passed"):
        group.broadcast(torch.zeros(1), 0, expired)
    assert group.aborted
    with pytest.raises(RefitAbortedError, match="deadline passed"):
        group.barrier(Deadline.after(5))


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="not in a world"):
        GroupSpec("127.0.0.1", 1234, 2, 2)
    with pytest.raises(ValueError, match="port"):
        GroupSpec("127.0.0.1", 0, 0, 2)
    with pytest.raises(ValueError, match="unknown backend"):
        GroupSpec("127.0.0.1", 1234, 0, 2, backend="mpi")  # type: ignore[arg-type]


def test_rendezvous_conventions() -> None:
    refit, vllm, sglang = convention_of("refit"), convention_of("vllm"), convention_of("sglang")
    assert refit.store_prefix("g", "127.0.0.1", 1234, "gloo") == "g"
    assert vllm.store_prefix("g", "127.0.0.1", 1234, "gloo") == "tcp://127.0.0.1:1234"
    assert vllm.store_prefix("g", "::1", 1234, "gloo") == "tcp://[::1]:1234"
    assert sglang.store_prefix("g", "127.0.0.1", 1234, "gloo") == "g/g//cpu/"
    assert sglang.store_prefix("g", "127.0.0.1", 1234, "nccl") == "g/g//cuda/"
    assert refit.expected_warm_up(3) == 3.0 and vllm.expected_warm_up(3) == 0.0
    assert sglang.warm_up_value is None
    with pytest.raises(ValueError, match="unknown rendezvous"):
        GroupSpec("127.0.0.1", 1234, 0, 2, rendezvous="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="known backend"):
        GroupSpec("127.0.0.1", 1234, 0, 2, None, rendezvous="vllm")


def test_nccl_on_vllms_rendezvous_is_vllms_own_communicator() -> None:
    traits = traits_for("nccl", "vllm")
    assert traits.raw_store and traits.warms_up_itself and traits.abort_releases
    assert traits_for("nccl", "refit") is traits_of("nccl") and not traits_of("nccl").raw_store
    assert traits_for("gloo", "vllm") is traits_of("gloo")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_nccl_group_without_vllm_is_refused_before_the_rendezvous() -> None:
    port = free_port()
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", port, 0, 2, "nccl", rendezvous="vllm"))
    with pytest.raises(BackendNotInstalledError, match="needs vLLM on the trainer") as caught:
        group.connect(Deadline.after(5))
    assert caught.value.install_hint.startswith("pip install vllm")
    with socket.socket() as probe:  # no store was ever opened on the port
        probe.bind(("127.0.0.1", port))


@pytest.mark.timeout(30)
def test_vllm_rendezvous_group_warms_up_with_a_zero() -> None:
    group = AbortableProcessGroup(GroupSpec("127.0.0.1", free_port(), 0, 1, rendezvous="vllm"))
    group.connect(Deadline.after(10))
    data = torch.arange(3.0)
    group.broadcast(data, 0, Deadline.after(5))
    assert group.connected and data.tolist() == [0.0, 1.0, 2.0]
    group.abort("done")
