"""LoRA adapters from memory inside one vLLM worker: refit's adapter store under vLLM's LoRA
manager.

vLLM 0.32 loads an adapter only from a directory (``WorkerLoRAManager._load_adapter`` reads
``adapter_config.json`` and the safetensors file of ``LoRARequest.lora_path``), and loads it
again whenever it needs it: on first use, after its LRU cache evicted it, after a base-weight
refit dropped every adapter (``reset_lora_state``). The worker's manager is given one more
source: a request whose path starts with :data:`~refit_zmq.lora.load.SCHEME` is built from
the version the worker's :class:`~refit_zmq.lora.store.AdapterStore` holds (vLLM's own
``PEFTHelper`` checks and ``LoRAModel.from_lora_tensors``, on fresh copies, since vLLM folds
the scaling into its tensors in place). Every other request loads from disk as before.

A request for a version the store no longer holds fails inside the engine's step, which
vLLM treats as fatal: versions are dropped only when no request can still name them
(:class:`~refit_zmq.vllm.lora_generation.VllmLoraGeneration`).

Only a vLLM worker imports this module (through the worker extension's LoRA calls).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

from refit_core import GeometryMismatchError, RefitError
from refit_zmq.lora.carrier import opened
from refit_zmq.lora.load import SCHEME, AdapterLoad, adapter_path, served_name
from refit_zmq.lora.store import AdapterStore, HeldVersion

__all__ = ["WorkerAdapters", "worker_adapters"]

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_refit_lora_adapters"


class WorkerAdapters:
    """The store of one worker, and the worker's LoRA manager reading from it."""

    def __init__(self, worker: Any) -> None:
        manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if manager is None:
            raise RefitError(
                "this vLLM engine serves no LoRA adapters: start it with enable_lora=True"
            )
        self.worker = worker
        self.manager = manager
        self.store = AdapterStore()
        from_disk = manager._load_adapter

        def load(request: LoRARequest) -> LoRAModel:
            if request.lora_path.startswith(SCHEME):
                return self.build(request)
            return from_disk(request)

        manager._load_adapter = load

    def build(self, request: LoRARequest) -> LoRAModel:
        """The ``LoRAModel`` vLLM gets for ``request`` (a fresh one each time)."""
        held = self.store.by_id(request.lora_int_id)
        if held is None or request.lora_path != adapter_path(held.adapter, held.version):
            raise RefitError(
                f"LoRA {request.lora_name!r} ({request.lora_path}, id {request.lora_int_id}) is "
                "not held by refit here: it was retired, or never loaded"
            )
        manager = self.manager
        peft = PEFTHelper.from_dict(
            {**held.config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        peft.validate_legal(manager.lora_config)
        adapters = manager._adapter_manager
        mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
        mapper = None if mapper is None else mapper.get_rename_mapper()
        _check_modules(held, _targetable(adapters), mapper)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=request.lora_int_id,
            tensors={name: tensor.clone() for name, tensor in held.tensors.items()},
            peft_helper=peft,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
        )
        lora.is_3d_lora_weight = request.is_3d_lora_weight
        for check in (
            "_validate_moe_lora_format",
            "_validate_modules_to_save",
            "_validate_token_classification_lora",
        ):
            getattr(adapters, check)(lora)
        return lora

    def load(self, message: Mapping[str, Any]) -> dict[str, float]:
        """Hold a new version and register it with vLLM (checked and built as any request for
        it will be); on any failure nothing is held or registered. Seconds each step took
        (``apply``: the payloads into a new version, ``register``: vLLM's part)."""
        started = time.perf_counter()
        load = AdapterLoad.from_message(message, opened(message["payloads"]))
        held = self.store.receive(load)
        applied = time.perf_counter()
        try:
            self.worker.add_lora(_request(held))
        except BaseException:
            self.worker.remove_lora(held.lora_id)
            self.store.drop(held.adapter, held.version)
            raise
        return {"apply": applied - started, "register": time.perf_counter() - applied}

    def serve(self, adapter: str, version: int, keep: list[int] | None) -> None:
        """New requests get ``version``; versions neither served nor in ``keep`` go (None:
        every version stays)."""
        self.store.serve(adapter, version)
        if keep is None:
            return
        for retired in self.store.retire(adapter, set(keep)):
            self.worker.remove_lora(retired.lora_id)

    def drop(self, adapter: str, version: int) -> None:
        """Forget a version that never served (a failed refit's)."""
        dropped = self.store.drop(adapter, version)
        if dropped is not None:
            self.worker.remove_lora(dropped.lora_id)


def _request(held: HeldVersion) -> LoRARequest:
    return LoRARequest(
        served_name(held.adapter, held.version),
        held.lora_id,
        adapter_path(held.adapter, held.version),
    )


def _targetable(adapters: Any) -> set[str]:
    """The module names an adapter of this model may target (packed modules by their parts)."""
    packed: Mapping[str, list[str]] = adapters.packed_modules_mapping
    names: set[str] = set()
    for module in adapters.supported_lora_modules:
        names.update(packed.get(module, [module]))
        if module == "experts":
            names.add(module)
    return names


def _check_modules(held: HeldVersion, targetable: set[str], mapper: Any) -> None:
    """Refuse an adapter with a tensor for a module the model cannot adapt (vLLM would ignore
    it silently)."""
    unknown = []
    for name in held.tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        at = module.find(".experts")
        target = module[at + 1 :] if at >= 0 else module.rsplit(".", 1)[-1]
        if target not in targetable:
            unknown.append(name)
    if unknown:
        raise GeometryMismatchError(
            f"adapter {held.adapter!r} version {held.version}: tensors for modules this model "
            f"cannot adapt ({sorted(targetable)}): {unknown[:3]}"
        )


def worker_adapters(worker: Any) -> WorkerAdapters:
    """The worker's adapters (built, and its LoRA manager given refit's source, on first use).

    Raises:
        RefitError: the engine serves no LoRA adapters.
    """
    adapters = getattr(worker, _ATTRIBUTE, None)
    if adapters is None:
        adapters = WorkerAdapters(worker)
        setattr(worker, _ATTRIBUTE, adapters)
    return adapters
