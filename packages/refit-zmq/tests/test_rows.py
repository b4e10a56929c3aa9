"""refit-zmq's rows through the factory: options typed per row, sizes, no clusters needed."""

from __future__ import annotations

import pytest
import torch

from refit_core import create_weight_synchronizer
from refit_core.sources import StateDictSource
from refit_zmq.ipc import IpcOptions, IpcWeightSynchronizer
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer

MiB = 1 << 20


class Trainer:
    def weight_source(self) -> StateDictSource:
        return StateDictSource({"w": torch.zeros(4)})


class Relays:
    """Engines whose relays listen at these addresses (nothing is contacted before a refit)."""

    def relay_addresses(self) -> list[str]:
        return ["tcp://127.0.0.1:1"]


class Receivers:
    def ipc_addresses(self) -> list[str]:
        return ["ipc:///nonexistent"]


def test_sparse_row_takes_its_options_and_no_cluster() -> None:
    options = ZmqSparseOptions(bucket_size_bytes=2 * MiB, verify_digests=True)
    sync = create_weight_synchronizer(
        Trainer(), Relays(), "vllm", False, transport="zmq_sparse", options=options
    )
    assert isinstance(sync, ZmqSparseWeightSynchronizer)
    assert sync.options == options
    sized = create_weight_synchronizer(
        Trainer(), Relays(), "vllm", False, refit_buffer_size_gb=1 / 1024, transport="zmq_sparse",
        options=ZmqSparseOptions(verify_digests=True),
    )  # fmt: skip
    assert isinstance(sized, ZmqSparseWeightSynchronizer)
    assert (sized.options.bucket_size_bytes, sized.options.verify_digests) == (MiB, True)
    with pytest.raises(ValueError, match="disagree"):
        create_weight_synchronizer(
            Trainer(), Relays(), "vllm", False, refit_buffer_size_gb=1.0,
            transport="zmq_sparse", options=options,
        )  # fmt: skip
    with pytest.raises(ValueError, match="must be ZmqSparseOptions"):
        create_weight_synchronizer(
            Trainer(), Relays(), "vllm", False, transport="zmq_sparse", options=IpcOptions()
        )


def test_ipc_row_takes_its_options() -> None:
    sync = create_weight_synchronizer(
        Trainer(), Receivers(), "vllm", True, refit_buffer_size_gb=1 / 1024,
        options=IpcOptions(device="cpu"),
    )  # fmt: skip
    assert isinstance(sync, IpcWeightSynchronizer)
    assert sync.options == IpcOptions(buffer_size_bytes=MiB, device="cpu")
