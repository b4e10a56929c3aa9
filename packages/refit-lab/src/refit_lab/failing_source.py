"""A trainer that dies mid-transfer: a weight source raising after a number of tensors."""

from __future__ import annotations

from collections.abc import Iterator

from refit_core import NamedTensor, StateDictInfo
from refit_core.sources import WeightSource

__all__ = ["FailingSource"]


class FailingSource:
    """``source``, raising ``RuntimeError`` when it would hand out tensor number ``after``."""

    def __init__(self, source: WeightSource, after: int) -> None:
        self._source = source
        self._after = after

    def state_dict_info(self) -> StateDictInfo:
        return self._source.state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        for index, named in enumerate(self._source.iter_tensors()):
            if index == self._after:
                raise RuntimeError("the trainer failed mid-transfer (injected fault)")
            yield named
