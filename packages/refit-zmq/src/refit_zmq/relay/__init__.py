"""The transactional ZeroMQ relay tree for sparse refits (wire protocol: PROTOCOL.md).

Producers stream delta payloads with :func:`stream_sparse_delta_payloads_via_zmq` (over a
:class:`ZmqSparseRefitClient`) into relays (:class:`ZmqSparseRefitServer`) that apply them to
a local receiver (:class:`TensorReceiver`) and forward them down a k-ary tree; a
:class:`RelayCoordinator` ends each transfer in commit or abort on every relay.

The modules are laid out by the process they run in: ``wire`` (what every side shares:
frames, reports, keys, errors, tuning, links), ``node`` (the relay process), ``apply``
(receivers, in the relay's process), ``producer`` (a trainer rank) and ``coordinator`` (the
controller); ``launch`` starts a relay process (its command line, ``refit relay serve`` or
``python -m refit_zmq.relay``, is :mod:`refit_zmq.relay_cli`). Every public name is
importable from here; the names import zmq and torch on first use.
"""

from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

if TYPE_CHECKING:
    from refit_zmq.relay.apply.receiver import (
        PayloadSink,
        Receiver,
        StreamingReceiver,
        TensorReceiver,
        admit_target,
    )
    from refit_zmq.relay.coordinator.coordinator import (
        DECISION_GRACE_S,
        RelayCoordinator,
        Statuses,
        new_transfer_id,
    )
    from refit_zmq.relay.coordinator.outcome import TransferOutcome
    from refit_zmq.relay.coordinator.transfer import (
        PreparedTransfer,
        TransferResult,
        decide_transfer,
        prepare_transfer,
        run_transfer,
    )
    from refit_zmq.relay.node.server import ZmqSparseRefitServer
    from refit_zmq.relay.producer.client import Acknowledged, ZmqSparseRefitClient
    from refit_zmq.relay.producer.shard import (
        ShardProducer,
        ShardProducerRole,
        StreamOrder,
        TransferOptions,
    )
    from refit_zmq.relay.producer.streaming import (
        deliver_payloads,
        stream_sparse_delta_payloads_via_zmq,
    )
    from refit_zmq.relay.wire.curve import CurveConfig
    from refit_zmq.relay.wire.errors import (
        NackCode,
        StaleTransferError,
        TransferConflictError,
        TreeMismatchError,
    )
    from refit_zmq.relay.wire.frames import PROTOCOL
    from refit_zmq.relay.wire.reports import (
        AbortReply,
        ApplyResult,
        ChildCounts,
        CommitReply,
        Failure,
        FlushReport,
        LedgerOpen,
        OutcomeReply,
        ReceiverOpen,
        ReceiverStatus,
        RelayStatus,
        SubtreeReport,
        TransferState,
        TreeReply,
    )
    from refit_zmq.relay.wire.tree import RelayTree
    from refit_zmq.relay.wire.tuning import RelayTuning
else:
    __getattr__ = lazy_facade(
        __name__,
        (
            "refit_zmq.relay.apply.receiver",
            "refit_zmq.relay.coordinator.coordinator",
            "refit_zmq.relay.coordinator.outcome",
            "refit_zmq.relay.coordinator.transfer",
            "refit_zmq.relay.node.server",
            "refit_zmq.relay.producer.client",
            "refit_zmq.relay.producer.shard",
            "refit_zmq.relay.producer.streaming",
            "refit_zmq.relay.wire.curve",
            "refit_zmq.relay.wire.errors",
            "refit_zmq.relay.wire.frames",
            "refit_zmq.relay.wire.reports",
            "refit_zmq.relay.wire.tree",
            "refit_zmq.relay.wire.tuning",
        ),
    )

__all__ = [
    "DECISION_GRACE_S",
    "PROTOCOL",
    "AbortReply",
    "Acknowledged",
    "ApplyResult",
    "ChildCounts",
    "CommitReply",
    "CurveConfig",
    "Failure",
    "FlushReport",
    "LedgerOpen",
    "NackCode",
    "OutcomeReply",
    "PayloadSink",
    "PreparedTransfer",
    "Receiver",
    "ReceiverOpen",
    "ReceiverStatus",
    "RelayCoordinator",
    "RelayStatus",
    "RelayTree",
    "RelayTuning",
    "ShardProducer",
    "ShardProducerRole",
    "StaleTransferError",
    "Statuses",
    "StreamOrder",
    "StreamingReceiver",
    "SubtreeReport",
    "TensorReceiver",
    "TransferConflictError",
    "TransferOptions",
    "TransferOutcome",
    "TransferResult",
    "TransferState",
    "TreeMismatchError",
    "TreeReply",
    "ZmqSparseRefitClient",
    "ZmqSparseRefitServer",
    "admit_target",
    "decide_transfer",
    "deliver_payloads",
    "new_transfer_id",
    "prepare_transfer",
    "run_transfer",
    "stream_sparse_delta_payloads_via_zmq",
]
