"""Dynamo's RL admin routes used for a refit, and the payloads refit posts to them.

Route names and bodies follow Dynamo's vLLM worker handlers (``ai-dynamo`` 1.6.1,
``dynamo/vllm/handlers.py`` and ``worker_factory.py``): each route is served at
``{system_url}/engine/{route}``; ``engine_rpc`` names the vLLM worker method that
``collective_rpc`` runs and every other key (except Dynamo's reserved ``allow_unpaused``,
``reset_prefix_cache`` and ``weight_version``) becomes its keyword arguments, untouched: Dynamo
reads none of them. A call succeeded when the JSON answer has ``status == "ok"``.

The keyword arguments are vLLM's worker methods' (``vllm/v1/worker/gpu_worker.py``, read in
vLLM 0.31.0, which ai-dynamo 1.6.1 pins, and in 0.32.0; the same in both):
``init_weight_transfer_engine(init_info)`` parsed into ``NCCLWeightTransferInitInfo``, which
carries the packing geometry (``packed``, ``packed_buffer_size_bytes``,
``packed_num_buffers``); ``start_weight_update()`` with no argument;
``update_weights(update_info)`` parsed into ``NCCLWeightTransferUpdateInfo`` (``names``,
``dtype_names``, ``shapes`` and nothing else: an unknown key is a ``ValueError``);
``finish_weight_update()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from refit_core import StateDictInfo
from refit_core.backend import CollectiveSenderSpec

__all__ = [
    "INIT_ROUTE",
    "PAUSE_PAYLOAD",
    "PAUSE_ROUTE",
    "RESUME_PAYLOAD",
    "RESUME_ROUTE",
    "UPDATE_ROUTE",
    "Step",
    "init_payload",
    "update_info",
    "update_steps",
]

INIT_ROUTE = "init_weights_update_group"
UPDATE_ROUTE = "update_weights_from_distributed"
PAUSE_ROUTE = "pause_generation"
RESUME_ROUTE = "resume_generation"

PAUSE_PAYLOAD: Mapping[str, Any] = MappingProxyType({"mode": "wait", "clear_cache": True})
"""Let running requests finish, then drop every KV/prefix cache entry."""
RESUME_PAYLOAD: Mapping[str, Any] = MappingProxyType({})

_IN_FLIGHT = {"allow_unpaused": True, "reset_prefix_cache": False}
"""Weights change while the worker keeps serving; the cache is flushed after the refit."""


@dataclass(frozen=True)
class Step:
    """One admin call of a transaction: ``route`` with ``payload``; ``rpc`` names it."""

    rpc: str
    route: str
    payload: Mapping[str, Any]


def init_payload(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    spec: CollectiveSenderSpec,
    *,
    vllm_nccl: bool = False,
) -> dict[str, Any]:
    """Body of ``init_weights_update_group``: join the trainer's group at ``rank_offset``.

    The packing geometry travels in the init info (vLLM's ``NCCLWeightTransferInitInfo``), so
    both sides pack alike whatever the worker's defaults are (vLLM's own default is unpacked).
    With ``vllm_nccl`` (workers on vLLM's NCCL data plane) the init info is built by the
    trainer's vLLM dataclass.

    Raises:
        BackendNotInstalledError: ``vllm_nccl`` and vLLM does not import here.
    """
    if vllm_nccl:
        from refit_nccl.vllm_native import nccl_init_info

        info = nccl_init_info(master_address, master_port, rank_offset, world_size, spec)
    else:
        info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": spec.buffer_size_bytes,
            "packed_num_buffers": spec.num_buffers,
        }
    return {"engine_rpc": "init_weight_transfer_engine", "init_info": info}


def update_info(
    info: StateDictInfo, *, vllm_nccl: CollectiveSenderSpec | None = None
) -> dict[str, Any]:
    """vLLM's update info for ``info`` (in transfer order): names, dtype names, shapes.

    With ``vllm_nccl`` (the packing geometry of workers on vLLM's NCCL data plane) it is built
    by the trainer's vLLM (``NCCLWeightTransferUpdateInfo``).

    Raises:
        BackendNotInstalledError: ``vllm_nccl`` and vLLM does not import here.
    """
    if vllm_nccl is not None:
        from refit_nccl.vllm_native import nccl_update_info

        return nccl_update_info(info, vllm_nccl)
    if not info:
        raise ValueError("state_dict_info is empty")
    return {
        "names": list(info),
        "dtype_names": [s.dtype for s in info.values()],
        "shapes": [list(s.shape) for s in info.values()],
    }


def update_steps(info: Mapping[str, Any], weight_version: int | None = None) -> tuple[Step, ...]:
    """The three calls of one worker's update: start, receive ``info``, finish.

    ``weight_version``, if given, rides on the finish call, where Dynamo records it as the
    version the worker serves (a reserved key, not passed to the engine).
    """
    version = {} if weight_version is None else {"weight_version": weight_version}
    return (
        _update_call("start_weight_update"),
        _update_call("update_weights", update_info=dict(info)),
        _update_call("finish_weight_update", **version),
    )


def _update_call(rpc: str, **kwargs: Any) -> Step:
    return Step(rpc, UPDATE_ROUTE, {"engine_rpc": rpc, **kwargs, **_IN_FLIGHT})
