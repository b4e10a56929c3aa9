"""What names and shapes one LoRA adapter a synchronizer moves (the ``lora`` row's options)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from refit_core.backend import check_field_types

__all__ = ["LoraOptions"]

_ADAPTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class LoraOptions:
    """One adapter: its name and its PEFT configuration (what vLLM reads from an adapter's
    ``adapter_config.json``), and how its payloads are cut.

    Attributes:
        adapter: the adapter's name; every version of it is served as ``{adapter}@v{version}``.
        rank: the LoRA rank ``r`` (every ``lora_A`` has this many rows).
        alpha: ``lora_alpha`` (the update is scaled by ``alpha / rank``, or
            ``alpha / sqrt(rank)`` with ``use_rslora``).
        target_modules: the module names the adapter targets (``("q_proj", "v_proj")``).
        use_rslora: rank-stabilized scaling.
        compress: zstd on the payloads' byte planes where it pays (worth its CPU time only
            where the engine's RPC crosses a slow link: a float32 adapter shrinks by ~15 %).
        rpc_timeout_s: bound of each engine call when the refit has no deadline.
    """

    adapter: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    compress: bool = False
    rpc_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        check_field_types(self)
        if not _ADAPTER.match(self.adapter):
            raise ValueError(
                f"adapter name must be letters, digits, '_', '.', '-', got {self.adapter!r}"
            )
        if self.rank < 1 or self.alpha <= 0:
            raise ValueError(f"rank and alpha must be positive, got {self.rank}, {self.alpha}")
        if not self.target_modules:
            raise ValueError("target_modules names at least one module")
        if self.rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}")

    def peft_config(self) -> dict[str, Any]:
        """The adapter's configuration as PEFT writes it (``adapter_config.json``)."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
        }
