"""The (vllm, non-colocated, ``zmq_sparse``) row: sparse refits over the relay tree.

:class:`EngineRelay` runs a relay beside each engine worker; the
:class:`ZmqSparseWeightSynchronizer` drives the producers and the coordinator.
"""

from refit_zmq.sparse.endpoint import EngineRelay, RelayEngine
from refit_zmq.sparse.synchronizer import (
    API_KEY_ENV,
    ZmqSparseOptions,
    ZmqSparseWeightSynchronizer,
)

__all__ = [
    "API_KEY_ENV",
    "EngineRelay",
    "RelayEngine",
    "ZmqSparseOptions",
    "ZmqSparseWeightSynchronizer",
]
