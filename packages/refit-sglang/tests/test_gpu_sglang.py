"""Both rows against real SGLang on a GPU (``gpu``; skipped elsewhere): HTTP servers, and
the colocated row into an ``sglang.Engine`` in the test's process through ``EngineClient``.

Needs ``sglang`` importable, a CUDA GPU, and ``REFIT_SGLANG_MODEL``: the path of a small
local Hugging Face checkpoint (safetensors) the engine can load without a network. The trainer
holds that checkpoint's tensors (bf16); a refit first moves perturbed weights, checked bitwise
through ``get_weights_by_name`` and the served weight version through ``get_model_info``, then
the original weights, after which greedy generation must equal the engine's generation before
any refit (so every tensor and the cache flush made it). The disaggregated row needs a second
GPU: NCCL refuses two ranks on one device.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from refit_core import WeightSynchronizer, create_weight_synchronizer
from refit_core.sources import StateDictSource
from refit_sglang import ColocatedOptions, ColocatedSGLangSynchronizer, EngineClient, HttpClient

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

_START_TIMEOUT_S = 600.0
_PROMPT = "The capital of France is"
_GREEDY = {"temperature": 0, "max_new_tokens": 16}
_PROBED = ("embed_tokens.weight", "layernorm.weight", "o_proj.weight", "down_proj.weight")
"""Tensors read back through ``/get_weights_by_name``: those SGLang keeps under the
checkpoint's name (it fuses q/k/v and gate/up into other parameters)."""


class _Checkpoint:
    """A ``PolicyLike`` over the model's own tensors, optionally perturbed."""

    def __init__(self, model: Path) -> None:
        from safetensors.torch import load_file

        self.original: dict[str, torch.Tensor] = {}
        for file in sorted(model.glob("*.safetensors")):
            self.original.update({n: t.to(torch.bfloat16) for n, t in load_file(str(file)).items()})
        if not self.original:
            pytest.skip(f"no safetensors in {model}")
        self.state = dict(self.original)

    def perturb(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.state = {
            n: (t.float() + 1e-3 * torch.randn(t.shape, generator=generator)).to(t.dtype)
            for n, t in self.original.items()
        }

    def restore(self) -> None:
        self.state = dict(self.original)

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _launch(model: Path, gpu: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model)]
    command += ["--port", str(port), "--mem-fraction-static", "0.3", "--disable-cuda-graph"]
    command += ["--dtype", "bfloat16"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sglang.launch_server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health_generate", timeout=10).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    process.kill()
    raise TimeoutError(f"the SGLang server did not start within {_START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def model() -> Path:
    pytest.importorskip("sglang")
    path = os.environ.get("REFIT_SGLANG_MODEL")
    if not path:
        pytest.skip("set REFIT_SGLANG_MODEL to a small local Hugging Face checkpoint")
    return Path(path)


@pytest.fixture
def server(model: Path) -> Iterator[Callable[[int], str]]:
    """Starts servers on given GPUs; all are stopped after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def start(gpu: int) -> str:
        process, url = _launch(model, gpu)
        started.append(process)
        return url

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


class _Served:
    """What a test reads from one engine: greedy text, a tensor, the weight version."""

    def __init__(
        self,
        generate: Callable[[], str],
        read: Callable[[str, int], object],
        version: Callable[[], object],
    ) -> None:
        self.generate, self.read, self.version = generate, read, version

    @classmethod
    def over_http(cls, url: str) -> _Served:
        def generate() -> str:
            body = {"text": _PROMPT, "sampling_params": _GREEDY}
            return str(_http(httpx.post(f"{url}/generate", json=body, timeout=120))["text"])

        def read(name: str, numel: int) -> object:
            body = {"name": name, "truncate_size": numel}
            return _http(httpx.post(f"{url}/get_weights_by_name", json=body, timeout=120))

        def version() -> object:
            return _http(httpx.get(f"{url}/get_model_info", timeout=60))["weight_version"]

        return cls(generate, read, version)

    @classmethod
    def in_process(cls, engine: Any) -> _Served:
        """``sglang.Engine``'s own ``generate``, ``get_weights_by_name``, ``get_model_info``."""
        return cls(
            lambda: str(engine.generate(prompt=_PROMPT, sampling_params=_GREEDY)["text"]),
            lambda name, numel: engine.get_weights_by_name(name, truncate_size=numel),
            lambda: engine.get_model_info()["weight_version"],
        )


def _http(reply: httpx.Response) -> Any:
    reply.raise_for_status()
    return reply.json()


def _check_bitwise(served: _Served, policy: _Checkpoint) -> None:
    """The probed tensors read back equal to the trainer's (bf16 -> float is exact)."""
    probed = [name for name in sorted(policy.state) if name.endswith(_PROBED)]
    assert probed, "no tensor to read back"
    for name in probed[:8]:
        tensor = policy.state[name]
        values = torch.tensor(served.read(name, tensor.numel()), dtype=torch.float32).reshape(-1)
        assert torch.equal(values, tensor.float().reshape(-1)[: values.numel()]), name


def _refit_twice(
    synchronizer: WeightSynchronizer, policy: _Checkpoint, engines: list[_Served]
) -> None:
    before = [served.generate() for served in engines]
    policy.perturb()
    assert synchronizer.sync_weights().version == 1
    for served in engines:
        _check_bitwise(served, policy)
        assert served.version() == "1"
    policy.restore()
    assert synchronizer.sync_weights().version == 2
    assert [served.generate() for served in engines] == before
    assert [served.version() for served in engines] == ["2"] * len(engines)


def test_colocated_cuda_ipc(model: Path, server: Callable[[int], str]) -> None:
    url = server(0)
    policy = _Checkpoint(model)
    options = ColocatedOptions(bucket_size_bytes=64 << 20, device="cuda")
    clients = [HttpClient(url, control_timeout_s=300)]
    with ColocatedSGLangSynchronizer(
        policy, clients, refit_timeout_s=300, options=options
    ) as synchronizer:
        _refit_twice(synchronizer, policy, [_Served.over_http(url)])


def test_disaggregated_nccl(model: Path, server: Callable[[int], str]) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("the disaggregated row needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    url = server(1)
    policy = _Checkpoint(model)
    with create_weight_synchronizer(
        policy, [url], "sglang", colocated=False, refit_buffer_size_gb=0.05, refit_timeout_s=300
    ) as synchronizer:
        _refit_twice(synchronizer, policy, [_Served.over_http(url)])


def test_colocated_in_process_engine(model: Path) -> None:
    """The colocated row into an ``sglang.Engine`` in this process: ``EngineClient`` drives
    its TokenizerManager on ``engine.loop`` (pause with a mode, versioned updates)."""
    import sglang

    engine = sglang.Engine(
        model_path=str(model), mem_fraction_static=0.3, disable_cuda_graph=True, dtype="bfloat16"
    )
    try:
        policy = _Checkpoint(model)
        options = ColocatedOptions(bucket_size_bytes=64 << 20, device="cuda")
        with ColocatedSGLangSynchronizer(
            policy, [EngineClient(engine)], options=options
        ) as synchronizer:
            _refit_twice(synchronizer, policy, [_Served.in_process(engine)])
    finally:
        engine.shutdown()
