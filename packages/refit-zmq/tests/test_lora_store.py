"""A worker's adapter store: versions built from real codec payloads (a resync, then deltas
applied to a copy of their base), each refused one leaving every held version as it was."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Mapping

import pytest
import torch

from refit_core import (
    ChecksumMismatchError,
    GeometryMismatchError,
    NamedTensor,
    RefitError,
    StaleBaseError,
    TensorSpec,
    WeightVersion,
)
from refit_zmq.lora import (
    AdapterLoad,
    AdapterStore,
    LoraOptions,
    adapter_path,
    flatten,
    served_name,
)
from refit_zmq.lora.carrier import carried
from refit_zmq.tracker import DeltaCompressionTracker

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
CONFIG = LoraOptions("math", 4, 8.0, ("q_proj",)).peft_config()


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    """A in float32, B in bfloat16: two flat buffers."""
    generator = torch.Generator().manual_seed(seed)
    return {
        A: torch.randn(4, 32, generator=generator),
        B: torch.randn(64, 4, generator=generator).to(torch.bfloat16),
    }


def _stepped(adapter: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stepped = {name: tensor.clone() for name, tensor in adapter.items()}
    stepped[B][3, 1] += 1.0  # one element of one tensor changes
    return stepped


class Trainer:
    """The codec's sender: one tracker over the adapter's flat buffers."""

    def __init__(self, adapter: Mapping[str, torch.Tensor]) -> None:
        self.specs = {
            n: (TensorSpec.of(t).shape, TensorSpec.of(t).dtype) for n, t in adapter.items()
        }
        flats = flatten(self.specs, [NamedTensor(n, t) for n, t in adapter.items()])
        self.tracker = DeltaCompressionTracker({n: TensorSpec.of(t) for n, t in flats.items()})

    def load(self, adapter: Mapping[str, torch.Tensor], version: int, lora_id: int) -> AdapterLoad:
        base = self.tracker.version
        flats = flatten(self.specs, [NamedTensor(n, t) for n, t in adapter.items()])
        payloads = [p.to_bytes() for p in self.tracker.encode(flats, WeightVersion(version))]
        self.tracker.commit()
        return AdapterLoad(
            "math",
            version,
            lora_id,
            None if base is None else base.value,
            self.specs,
            CONFIG,
            payloads,
        )


def _bits(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: t.contiguous().view(torch.uint8).numpy().tobytes() for name, t in tensors.items()}


def test_a_resync_then_a_delta_build_versions_side_by_side() -> None:
    first, second = _adapter(1), _stepped(_adapter(1))
    trainer, store = Trainer(first), AdapterStore()
    resync = trainer.load(first, 1, 101)
    assert resync.base is None
    store.receive(resync)
    delta = trainer.load(second, 2, 102)
    assert delta.base == 1 and sum(map(len, delta.payloads)) < sum(map(len, resync.payloads)) / 4
    store.receive(delta)
    assert _bits(store.find("math", 1).tensors) == _bits(first), "the base is untouched"
    assert _bits(store.find("math", 2).tensors) == _bits(second)
    held = store.by_id(102)
    assert held is not None and held.version == 2 and held.config == CONFIG
    assert store.serve("math", 2) is None
    assert store.status("math") == {
        "serving": 2,
        "lora_id": 102,
        "held": [1, 2],
        "began": 2,
        "max_lora_id": 102,
    }


def test_a_refused_load_holds_nothing_and_changes_nothing() -> None:
    first = _adapter(1)
    trainer, store = Trainer(first), AdapterStore()
    store.receive(trainer.load(first, 1, 101))
    store.serve("math", 1)
    delta = trainer.load(_stepped(first), 2, 102)
    only_a = Trainer({A: first[A]}).load({A: first[A]}, 2, 102).payloads  # no bfloat16 flat
    corrupted = bytearray(delta.payloads[0])
    corrupted[-1] ^= 0xFF
    refused = [
        (ChecksumMismatchError, "checksum", {"payloads": [bytes(corrupted)]}),
        (StaleBaseError, "does not hold", {"base": 7}),
        (RefitError, "not above the served version 1", {"version": 1}),
        (RefitError, "LoRA id 101 is held", {"lora_id": 101}),
        (GeometryMismatchError, "changes the tensors", {"specs": {A: ((4, 32), "float32")}}),
        (GeometryMismatchError, "did not carry", {"base": None, "payloads": only_a}),
    ]
    for error, says, fields in refused:
        with pytest.raises(error, match=says):
            store.receive(AdapterLoad(**{**delta.__dict__, **fields}))
        assert store.status("math")["held"] == [1]
        assert _bits(store.find("math", 1).tensors) == _bits(first)
    assert store.status("math")["began"] == 2, "refused loads of version 2 began"
    assert store.receive(delta).version == 2


def test_retiring_keeps_the_served_version_and_those_asked_for() -> None:
    first = _adapter(1)
    trainer, store = Trainer(first), AdapterStore()
    for version in (1, 2, 3, 4):
        store.receive(trainer.load(first, version, 100 + version))
    store.serve("math", 4)
    assert [v.version for v in store.retire("math", {2})] == [1, 3]
    assert store.status("math")["held"] == [2, 4]
    assert store.by_id(101) is None
    with pytest.raises(RefitError, match="is served"):
        store.drop("math", 4)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_load_travels_as_plain_values(shared_memory: bool) -> None:
    """In another process, as a worker gets it: the payloads in a memfd or inline."""
    load = Trainer(_adapter(1)).load(_adapter(1), 1, 101)
    with carried(load.payloads, shared_memory=shared_memory) as payloads:
        message = load.to_message(payloads)
        assert ("shm" in payloads) == shared_memory
        child = subprocess.run(
            [sys.executable, "-c", RECEIVER],
            input=pickle.dumps(message),
            capture_output=True,
            check=True,
            timeout=120,
        )
    assert AdapterLoad.from_message(message, pickle.loads(child.stdout)) == load
    with pytest.raises(RefitError, match="malformed adapter load"):
        AdapterLoad.from_message({"adapter": "math"}, [])
    assert (served_name("math", 3), adapter_path("math", 3)) == ("math@v3", "refit-lora://math/v3")


RECEIVER = """
import pickle, sys
from refit_zmq.lora import AdapterLoad
from refit_zmq.lora.carrier import opened
message = pickle.load(sys.stdin.buffer)
load = AdapterLoad.from_message(message, opened(message["payloads"]))
sys.stdout.buffer.write(pickle.dumps([bytes(p) for p in load.payloads]))
"""
"""A worker's side: the load it reads from a message."""


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"adapter": "a b"}, "adapter name"),
        ({"rank": 0}, "positive"),
        ({"target_modules": ()}, "at least one module"),
        ({"rank": 4.0}, "LoraOptions.rank takes int"),
        ({"target_modules": ["q_proj"]}, "target_modules takes tuple"),
    ],
)
def test_options_refuse_what_vllm_would_refuse_later(fields: dict[str, object], says: str) -> None:
    values: dict[str, object] = {
        "adapter": "math",
        "rank": 4,
        "alpha": 8.0,
        "target_modules": ("q_proj",),
    }
    with pytest.raises((TypeError, ValueError), match=says):
        LoraOptions(**{**values, **fields})  # type: ignore[arg-type]


def test_the_vllm_glue_loads_neither_the_codec_nor_torch() -> None:
    """vLLM imports refit-zmq's plugin in every engine process before its workers start; a
    worker that has imported numba's llvmlite fails vLLM 0.32's CPU kernel registration."""
    script = (
        "import sys, refit_zmq.vllm, refit_zmq.lora\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'numba', 'llvmlite', 'torch'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
