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


class AdapterEngines:
    """Engines holding adapter versions (nothing is asked before a refit)."""

    def adapter_status(self, adapter: str, timeout_s: float | None) -> list[object]:
        raise AssertionError("not called while building")

    def adopt(self, adapter: str, engines: object) -> None:
        raise AssertionError("not called while building")

    def new_lora_id(self) -> int:
        raise AssertionError("not called while building")

    def load_adapter(self, load: object, timeout_s: float | None) -> None:
        raise AssertionError("not called while building")

    def serve_adapter(self, load: object, timeout_s: float | None) -> dict[str, str]:
        raise AssertionError("not called while building")


@pytest.mark.parametrize("colocated", [True, False])
def test_lora_row_needs_its_options_and_takes_no_bucket_size(colocated: bool) -> None:
    from refit_zmq.lora import LoraOptions, LoraWeightSynchronizer

    options = LoraOptions("math", 8, 16.0, ("q_proj", "v_proj"))
    sync = create_weight_synchronizer(
        Trainer(), AdapterEngines(), "vllm", colocated, transport="lora", options=options
    )
    assert isinstance(sync, LoraWeightSynchronizer) and sync.options == options
    with pytest.raises(ValueError, match="needs options=LoraOptions"):
        create_weight_synchronizer(Trainer(), AdapterEngines(), "vllm", colocated, transport="lora")
    with pytest.raises(ValueError, match="no refit_buffer_size_gb"):
        create_weight_synchronizer(
            Trainer(), AdapterEngines(), "vllm", colocated, refit_buffer_size_gb=1.0,
            transport="lora", options=options,
        )  # fmt: skip
    with pytest.raises(ValueError, match="VllmLoraGeneration"):
        create_weight_synchronizer(
            Trainer(), Relays(), "vllm", colocated, transport="lora", options=options
        )
