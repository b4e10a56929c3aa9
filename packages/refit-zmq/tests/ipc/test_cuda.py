"""The CUDA IPC path: GPU buffers shared by handle with an engine in another process."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from refit_core import TensorSpec
from refit_core.sources import StateDictSource
from refit_lab.cuda_engine import serve_cuda_engine
from refit_lab.digest import state_digest
from refit_lab.faults import ProcessGang
from refit_zmq.ipc import IpcOptions, IpcWeightSynchronizer
from refit_zmq.ipc.sizing import ALIGN_BYTES, MAX_DEFAULT_BUFFER_BYTES, default_buffer_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

MiB = 1 << 20


class _Policy:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)


def test_refits_through_cuda_ipc_handles_are_bitwise() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {
        f"layer{i}.weight": torch.randn((256, 64 + i), generator=generator, device="cuda").to(
            torch.bfloat16
        )
        for i in range(8)
    }
    state["embed.weight"] = torch.randn((4096, 256), generator=generator, device="cuda")  # 4 MiB
    specs = {name: (spec.shape, spec.dtype) for name, spec in map(_spec, state.items())}
    address = f"ipc://{tempfile.gettempdir()}/refit-ipc-cuda-{os.getpid()}"
    options = IpcOptions(buffer_size_bytes=MiB, device="cuda")
    with ProcessGang() as gang:
        gang.spawn(serve_cuda_engine, address, specs, 2, gang.results)
        with IpcWeightSynchronizer(
            _Policy(state), lambda: [address], refit_timeout_s=120, options=options
        ) as synchronizer:
            synchronizer.sync_weights()
            for tensor in state.values():
                tensor.neg_()
            synchronizer.sync_weights()
        ((version, digests),) = gang.collect(1, timeout_s=120)
    assert version == 2
    assert digests == state_digest(state.items())


def test_default_gpu_buffers_are_bounded_and_aligned() -> None:
    size = default_buffer_bytes(torch.device("cuda", 0))
    assert size <= MAX_DEFAULT_BUFFER_BYTES and size % ALIGN_BYTES == 0


def _spec(item: tuple[str, torch.Tensor]) -> tuple[str, TensorSpec]:
    return item[0], TensorSpec.of(item[1])
