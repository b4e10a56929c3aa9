"""The init and update info of vLLM's NCCL weight transfer, built by vLLM's own dataclasses.

Which fields a receiver accepts moved between vLLM releases (0.32 carries the packing
geometry in the init info and refuses unknown update-info keys), so the trainer builds both
with the dataclasses of its installed vLLM (``NCCLWeightTransferInitInfo``,
``worker_init_payload``, ``NCCLWeightTransferUpdateInfo``) and never by hand; the trainer's
vLLM must be the engines' release.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refit_core import StateDictInfo
from refit_core.backend import CollectiveSenderSpec
from refit_nccl.vllm_native.availability import require_vllm_nccl

__all__ = ["nccl_init_info", "nccl_update_info"]


def _packing_fields(info_class: type, geometry: CollectiveSenderSpec) -> dict[str, Any]:
    """The packing geometry, as the fields ``info_class`` (a vLLM dataclass) has of it."""
    fields = {f.name for f in dataclasses.fields(info_class)}
    packing = {
        "packed": True,
        "packed_buffer_size_bytes": geometry.buffer_size_bytes,
        "packed_num_buffers": geometry.num_buffers,
    }
    return {key: value for key, value in packing.items() if key in fields}


def nccl_init_info(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    geometry: CollectiveSenderSpec,
) -> dict[str, Any]:
    """What ``init_weight_transfer_engine`` takes: join the trainer's group at ``rank_offset``
    and unpack buckets of ``geometry`` (where the installed vLLM's init info has the fields).

    Raises:
        BackendNotInstalledError: vLLM's helpers do not import here.
        ValueError: ``geometry`` is not vLLM's packing rule.
    """
    require_vllm_nccl()
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_payload,
    )

    if geometry.peer != "vllm":
        raise ValueError(f"vLLM's receiver unpacks by vLLM's rule, not {geometry.peer!r}'s")
    info = NCCLWeightTransferInitInfo(
        master_address=master_address,
        master_port=master_port,
        rank_offset=rank_offset,
        world_size=world_size,
        **_packing_fields(NCCLWeightTransferInitInfo, geometry),
    )
    payload: dict[str, Any] = worker_init_payload(info)
    return payload


def nccl_update_info(state: StateDictInfo, geometry: CollectiveSenderSpec) -> dict[str, Any]:
    """What ``update_weights`` takes for ``state`` (names, dtype names, shapes in transfer
    order; the packing geometry too where the installed vLLM's update info has the fields).

    Raises:
        BackendNotInstalledError: vLLM's helpers do not import here.
        ValueError: an empty state.
    """
    require_vllm_nccl()
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    if not state:
        raise ValueError("state_dict_info is empty")
    info = NCCLWeightTransferUpdateInfo(
        names=list(state),
        dtype_names=[spec.dtype for spec in state.values()],
        shapes=[list(spec.shape) for spec in state.values()],
        **_packing_fields(NCCLWeightTransferUpdateInfo, geometry),
    )
    return dataclasses.asdict(info)
