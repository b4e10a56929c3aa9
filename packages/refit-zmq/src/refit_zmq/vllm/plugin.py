"""The ``vllm.general_plugins`` entry point: registers refit-zmq's receiver with vLLM.

vLLM runs general plugins in every process it starts (engine core and workers) before the
model loads, so the backend name resolves wherever the worker builds its engine.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

logger = logging.getLogger(__name__)


def register() -> None:
    """Register :class:`~refit_zmq.vllm.engine.VllmRelayReceiver` (lazily imported)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from refit_zmq.vllm import BACKEND

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "refit_zmq.vllm.engine", "VllmRelayReceiver"
        )
    except ValueError:
        logger.debug("weight transfer engine %s already registered", BACKEND)
