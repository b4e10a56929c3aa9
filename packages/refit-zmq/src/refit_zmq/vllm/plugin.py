"""The ``vllm.general_plugins`` entry point: registers refit-zmq's receivers with vLLM.

vLLM runs general plugins in every process it starts (engine core and workers) before the
model loads, so the backend names resolve wherever the worker builds its engine.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the sparse relay and IPC receivers (each imported lazily, on first use)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from refit_zmq.vllm import BACKENDS

    for name, module, cls in BACKENDS.values():
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
        except ValueError:
            logger.debug("weight transfer engine %s already registered", name)
