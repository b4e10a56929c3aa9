"""The transactional ZeroMQ relay tree for sparse refits (wire protocol: PROTOCOL.md).

Producers stream delta payloads with :func:`stream_sparse_delta_payloads_via_zmq` (over a
:class:`ZmqSparseRefitClient`) into relays (:class:`ZmqSparseRefitServer`) that apply them to
a local receiver (:class:`TensorReceiver`) and forward them down a k-ary tree; a
:class:`RelayCoordinator` ends each transfer in commit or abort on every relay.
"""

from refit_zmq.relay.client import ZmqSparseRefitClient
from refit_zmq.relay.coordinator import RelayCoordinator, TransferOutcome, new_transfer_id
from refit_zmq.relay.curve import CurveConfig
from refit_zmq.relay.errors import (
    NackCode,
    StaleTransferError,
    TransferConflictError,
    TreeMismatchError,
)
from refit_zmq.relay.frames import PROTOCOL
from refit_zmq.relay.producer import (
    ShardProducer,
    ShardProducerRole,
    StreamOrder,
    TransferOptions,
)
from refit_zmq.relay.receiver import PayloadSink, Receiver, StreamingReceiver, TensorReceiver
from refit_zmq.relay.server import ZmqSparseRefitServer
from refit_zmq.relay.streaming import deliver_payloads, stream_sparse_delta_payloads_via_zmq
from refit_zmq.relay.transfer import TransferResult, run_transfer
from refit_zmq.relay.tree import RelayTree
from refit_zmq.relay.tuning import RelayTuning

__all__ = [
    "PROTOCOL",
    "CurveConfig",
    "NackCode",
    "PayloadSink",
    "Receiver",
    "RelayCoordinator",
    "RelayTree",
    "RelayTuning",
    "ShardProducer",
    "ShardProducerRole",
    "StaleTransferError",
    "StreamOrder",
    "StreamingReceiver",
    "TensorReceiver",
    "TransferConflictError",
    "TransferOptions",
    "TransferOutcome",
    "TransferResult",
    "TreeMismatchError",
    "ZmqSparseRefitClient",
    "ZmqSparseRefitServer",
    "deliver_payloads",
    "new_transfer_id",
    "run_transfer",
    "stream_sparse_delta_payloads_via_zmq",
]
