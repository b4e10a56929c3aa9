"""The (vllm, non-colocated, ``zmq_sparse``) row: sparse refits over the relay tree.

:class:`EngineRelay` runs a relay beside each engine worker; the
:class:`ZmqSparseWeightSynchronizer` drives the producers (trainer ranks serving
:class:`~refit_zmq.relay.ShardProducer`, see :class:`ZmqProducerPolicy`) and the coordinator.
"""

from refit_zmq.sparse.builder import ZmqProducerPolicy, shard_producers
from refit_zmq.sparse.endpoint import EngineRelay, RelayEngine
from refit_zmq.sparse.synchronizer import (
    API_KEY_ENV,
    ZmqSparseOptions,
    ZmqSparseWeightSynchronizer,
    attempt_timeout_s,
)

__all__ = [
    "API_KEY_ENV",
    "EngineRelay",
    "RelayEngine",
    "ZmqProducerPolicy",
    "ZmqSparseOptions",
    "ZmqSparseWeightSynchronizer",
    "attempt_timeout_s",
    "shard_producers",
]
