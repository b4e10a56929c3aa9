"""The checkpoint-format copy of a vLLM worker's weights that sparse deltas are applied to.

vLLM repacks its parameters at load (fused ``qkv_proj``, CPU kernel layouts), so a delta
against checkpoint tensors cannot be applied to them in place. :class:`ShadowWeights` keeps
one checkpoint-format copy (the relay's receiver writes it and rolls it back), and pushes
what changed since the last push into the model through vLLM's layerwise reload: every
decoder layer (or top-level module) holding a changed tensor, whole, since layerwise reload
processes a layer only once all of its tensors arrived.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from refit_core import RefitError
from refit_zmq.codec import tensor_digest

__all__ = ["ShadowWeights", "layer_of"]

logger = logging.getLogger(__name__)


def layer_of(name: str) -> str:
    """The unit a checkpoint tensor is reloaded with: its outermost indexed module
    (``model.layers.3``), else its parent module (``model.norm``)."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return name.rpartition(".")[0]


class ShadowWeights:
    """Checkpoint-named tensors plus what the model was last given.

    Args:
        weights: the checkpoint the model was loaded from (copied).
        version: the version they are.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        self.tensors = {name: t.detach().clone() for name, t in weights}
        self.version = version
        self.pushed_version = version
        self._pushed = self._digests()

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _digests(self) -> dict[str, int]:
        return {name: tensor_digest(t) for name, t in self.tensors.items()}

    def push(self, version: int, model: Any) -> int:
        """Load the layers changed since the last push into ``model`` (inside a layerwise
        reload the caller opened); the number of tensors loaded.

        Raises:
            RefitError: the shadow does not hold ``version`` (the relay did not commit it).
        """
        if version != self.version:
            raise RefitError(
                f"cannot serve version {version}: the relay committed {self.version}",
                is_retryable=True,
            )
        digests = self._digests()
        layers = {layer_of(n) for n, d in digests.items() if self._pushed.get(n) != d}
        items = [(n, t) for n, t in self.tensors.items() if layer_of(n) in layers]
        model.load_weights(items)
        self._pushed, self.pushed_version = digests, version
        logger.info("version %d pushed: %d tensors of %d layers", version, len(items), len(layers))
        return len(items)
