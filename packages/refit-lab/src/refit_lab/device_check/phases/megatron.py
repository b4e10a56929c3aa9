"""Phase ``megatron``: the Megatron colocated reshard on CUDA, through the factory row.

One process holds a GPT model's trainer shards and its inference shards on the GPU (TP 1 on
both sides: one GPU holds one rank), and ``create_weight_synchronizer(..., "megatron",
colocated=True)`` reshards in place, with no group. Each round negates the trainer's shards,
times a device-to-device copy of the same bytes, then a refit; the inference shards must end
bit for bit equal to the trainer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from refit_core import create_weight_synchronizer
from refit_lab.device_check.timing import interleaved_with_device_copy
from refit_nccl.megatron import GPTConfig, Parallelism, ParamLayout, gpt_layouts

__all__ = ["CONFIG", "ROUNDS", "run"]

CONFIG = GPTConfig(layers=8, hidden=2048, heads=16, query_groups=8, ffn=8192, vocab=32000)
"""About 1.3 GB of bf16."""
ROUNDS = 3


class _Side:
    """One side of the reshard as this process sees it (rank 0 of a TP-1 layout)."""

    def __init__(self, layouts: dict[str, ParamLayout], shards: dict[str, torch.Tensor]) -> None:
        self._layouts = layouts
        self._shards = shards

    def megatron_layouts(self) -> Mapping[str, ParamLayout]:
        return self._layouts

    def megatron_rank(self) -> int | None:
        return 0

    def megatron_shards(self) -> Mapping[str, torch.Tensor]:
        return self._shards


def run() -> dict[str, Any]:
    """Reshard rates against the device copy, and bit-exactness."""
    layouts = gpt_layouts(CONFIG, Parallelism())
    generator = torch.Generator(device="cuda").manual_seed(0)
    sources = {
        name: torch.randn(layout.local_shape(0), generator=generator, device="cuda").to(
            torch.bfloat16
        )
        for name, layout in layouts.items()
    }
    destinations = {name: torch.zeros_like(t) for name, t in sources.items()}
    total = sum(t.numel() * t.element_size() for t in sources.values())
    synchronizer = create_weight_synchronizer(
        _Side(layouts, sources), _Side(layouts, destinations), "megatron", True, refit_timeout_s=60
    )
    with synchronizer:
        synchronizer.sync_weights()  # warm-up
        measured = interleaved_with_device_copy(
            synchronizer.sync_weights, total, ROUNDS, lambda: [t.neg_() for t in sources.values()]
        )
    exact = all(
        torch.equal(destinations[n].view(torch.int16), t.view(torch.int16))
        for n, t in sources.items()
    )
    return {
        "ok": exact,
        "model_bytes": total,
        "parameters": len(layouts),
        "reshard_gbps": measured.subject_gbps,
        "device_copy_gbps": measured.reference_gbps,
        "reshard_vs_device_copy": measured.ratio,
        "bitexact": exact,
    }
