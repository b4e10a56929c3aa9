"""The (vllm, ``lora``) rows: LoRA adapters from the trainer's memory into running engines.

Trainer side: :class:`LoraWeightSynchronizer` (one per adapter, built by the factory through
:func:`build_lora_synchronizer` with :class:`LoraOptions`). Engine side: every worker holds
its adapters' versions in an :class:`AdapterStore`; vLLM's glue is
:mod:`refit_zmq.vllm.lora_worker` and :class:`~refit_zmq.vllm.VllmLoraGeneration`.

- :mod:`.options`: the adapter's name and PEFT configuration;
- :mod:`.load`: one version on its way to the workers, and its names in vLLM;
- :mod:`.flat`: an adapter as one flat buffer per dtype, and back;
- :mod:`.carrier`: how the payloads reach the workers (shared memory, or inline);
- :mod:`.store`: the versions one worker holds, built from codec payloads;
- :mod:`.synchronizer`, :mod:`.builder`: the synchronizer and the factory's builder.

Names are imported on first use: the controller's vLLM glue (imported by vLLM's plugin
loader in every engine process) reads :mod:`.load` without loading the codec.
"""

from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

__all__ = [
    "SCHEME",
    "AdapterEngine",
    "AdapterLoad",
    "AdapterStore",
    "HeldVersion",
    "LoraGeneration",
    "LoraOptions",
    "LoraWeightSynchronizer",
    "adapter_path",
    "build_lora_synchronizer",
    "flatten",
    "served_name",
    "views",
]

if TYPE_CHECKING:
    from refit_zmq.lora.builder import build_lora_synchronizer
    from refit_zmq.lora.flat import flatten, views
    from refit_zmq.lora.load import SCHEME, AdapterLoad, adapter_path, served_name
    from refit_zmq.lora.options import LoraOptions
    from refit_zmq.lora.store import AdapterStore, HeldVersion
    from refit_zmq.lora.synchronizer import AdapterEngine, LoraGeneration, LoraWeightSynchronizer
else:
    __getattr__ = lazy_facade(
        __name__,
        [
            "refit_zmq.lora.builder",
            "refit_zmq.lora.flat",
            "refit_zmq.lora.load",
            "refit_zmq.lora.options",
            "refit_zmq.lora.store",
            "refit_zmq.lora.synchronizer",
        ],
    )
