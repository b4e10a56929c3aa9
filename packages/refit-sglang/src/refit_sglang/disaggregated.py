"""The disaggregated SGLang synchronizer: refit-nccl's collective synchronizer that also
closes the engines' clients at shutdown, once their groups have been left."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from refit_nccl import CollectiveWeightSynchronizer
from refit_sglang.client import SGLangClient

__all__ = ["SGLangCollectiveSynchronizer"]

logger = logging.getLogger(__name__)


class SGLangCollectiveSynchronizer(CollectiveWeightSynchronizer):
    """A :class:`CollectiveWeightSynchronizer` that owns ``clients``: at shutdown every
    engine participant finishes leaving its group (bounded), then every client is closed.

    Args:
        clients: the engines' clients, closed at shutdown.
        args, kwargs: as for :class:`CollectiveWeightSynchronizer`.
    """

    def __init__(self, clients: Sequence[SGLangClient], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clients = tuple(clients)

    @property
    def clients(self) -> tuple[SGLangClient, ...]:
        """The engines' clients, in the order they were given."""
        return self._clients

    def _shutdown(self) -> None:
        super()._shutdown()
        for participants in self._shards().values():
            for participant in participants:
                participant.close()
        for client in self._clients:
            client.close()
        logger.info("closed %d SGLang clients", len(self._clients))
