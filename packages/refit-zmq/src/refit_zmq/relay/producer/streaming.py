"""One producer's half of a sparse refit: encode its shard and stream it into the relay tree.

Encoding overlaps sending: the tracker encodes the next payload on the calling thread (its
comparisons run on its own pool) while ``senders`` threads, each with its own DEALER, deliver
the previous ones. Producers of different shards call this concurrently, each rooted at
another relay, so the trees (and their inner relays) differ.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from refit_core import NamedTensor, RefitAbortedError, RefitError, WeightVersion
from refit_core.backend import Deadline
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay.producer.client import Acknowledged, ZmqSparseRefitClient
from refit_zmq.relay.wire.auth import api_key_from_env
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.tuning import RelayTuning
from refit_zmq.tracker import DeltaCompressionTracker

__all__ = ["deliver_payloads", "stream_sparse_delta_payloads_via_zmq"]

logger = logging.getLogger(__name__)


def stream_sparse_delta_payloads_via_zmq(
    iterator: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
    *,
    delta_tracker: DeltaCompressionTracker,
    refit_targets: Sequence[str],
    transfer_id: str,
    api_key_env_var: str | None,
    timeout_s: float,
    shard_rank: int,
    shard_count: int,
    target_version: int | None = None,
    resync: bool = False,
    verification_candidates: int = 64,
    tuning: RelayTuning | None = None,
    curve: CurveConfig | None = None,
    senders: int | None = None,
    deadline: Deadline,
    stop: threading.Event | None = None,
) -> dict[str, int]:
    """Encode this shard's refit and deliver every payload to its root relay.

    The tracker is left with the refit pending: commit it once the coordinator committed the
    transfer, abort it otherwise. On any error here it is aborted before the error propagates.

    Args:
        iterator: the new weights (``WeightSource.iter_tensors()`` or a mapping).
        delta_tracker: this shard's tracker (its config names ``shard_rank`` of ``shard_count``).
        refit_targets: the relays of the tree, in tree order; this shard roots at
            ``refit_targets[shard_rank % len(refit_targets)]``.
        transfer_id: the transfer (from the coordinator).
        api_key_env_var: the environment variable holding the API key (None: no key).
        timeout_s: longest wait for one reply (see :class:`ZmqSparseRefitClient`).
        shard_rank: this producer's shard.
        shard_count: how many producers share the state.
        target_version: the version the refit brings receivers to (default: next).
        resync: send every item densely (for receivers that lost track).
        verification_candidates: entries each receiver re-reads per payload (0: none).
        tuning: chunk size, retries, backoff.
        curve: the relays' CURVE public key, when they encrypt.
        senders: payloads in flight at once (one DEALER each; default: the tuning's
            ``window_payloads``, as many as the root stages for one tree).
        deadline: the refit's deadline; every BEGIN carries what is left of it, and no
            send or wait runs past it, nor any encoding: the stream ends at the first tensor
            or payload past it (``Deadline.never()``: none).
        stop: set by whoever takes over the tracker (a newer refit): the stream ends at its
            next tensor or payload, its refit aborted.

    Returns:
        ``payloads``, ``tensors``, ``changed_elements``, ``wire_bytes`` and ``dense_bytes``.
    """
    config = delta_tracker.config
    if (config.shard_rank, config.shard_count) != (shard_rank, shard_count):
        raise ValueError(
            f"tracker owns shard {config.shard_rank} of {config.shard_count}, "
            f"not {shard_rank} of {shard_count}"
        )
    tuning = tuning or RelayTuning()
    senders = tuning.window_payloads if senders is None else senders
    if not refit_targets or senders < 1:
        raise ValueError("need at least one relay and one sender")
    committed = delta_tracker.version
    target = (
        WeightVersion(target_version)
        if target_version is not None
        else (committed.next() if committed is not None else WeightVersion(1))
    )
    dense = resync or committed is None
    root = refit_targets[shard_rank % len(refit_targets)]
    client = ZmqSparseRefitClient(
        root,
        timeout_s=timeout_s,
        producer_id=f"shard-{shard_rank}",
        retries=tuning.retries,
        api_key=api_key_from_env(api_key_env_var),
        curve=curve,
        tuning=tuning,
    )
    watched = _watched(iterator, deadline, stop or threading.Event())
    payloads = delta_tracker.encode(watched, target, resync=resync)
    try:
        stats = deliver_payloads(
            payloads,
            client,
            transfer_id=transfer_id,
            payload_prefix=str(shard_rank),
            relay_root=root,
            base_version=None if dense or committed is None else committed.value,
            target_version=target.value,
            verification_candidates=verification_candidates,
            senders=senders,
            deadline=deadline,
            total_dense_bytes=sum(item.nbytes for item in delta_tracker.items),
        )
    except BaseException:
        _close(payloads)
        delta_tracker.abort()
        raise
    finally:
        client.close()
    logger.info(
        "shard %d of %d: %d payloads, %d wire bytes for %d dense (%s)",
        shard_rank,
        shard_count,
        stats["payloads"],
        stats["wire_bytes"],
        stats["dense_bytes"],
        "resync" if dense else f"delta from {committed}",
    )
    return stats


def deliver_payloads(
    payloads: Iterable[DeltaPayload],
    client: ZmqSparseRefitClient,
    *,
    transfer_id: str,
    payload_prefix: str,
    relay_root: str | None,
    base_version: int | None,
    target_version: int,
    verification_candidates: int,
    senders: int = 2,
    deadline: Deadline,
    total_dense_bytes: int | None = None,
) -> dict[str, int]:
    """Send ``payloads`` as they come, ``senders`` at a time (each thread its own DEALER),
    within ``deadline`` (see :meth:`ZmqSparseRefitClient.send_payload`).

    Payload ``i`` is named ``{payload_prefix}.{i}``. Returns ``payloads``, ``tensors``,
    ``changed_elements``, ``wire_bytes`` and ``dense_bytes``; raises the first send's error.
    A ``RefitError`` carries the share of ``total_dense_bytes`` (the shard's) that was
    encoded and handed to a sender by then as its ``progress``.
    """
    stats = {"payloads": 0, "tensors": 0, "changed_elements": 0, "wire_bytes": 0, "dense_bytes": 0}
    names: set[str] = set()
    in_flight: deque[Future[Acknowledged]] = deque()
    try:
        with ThreadPoolExecutor(senders, thread_name_prefix="refit-send") as pool:
            for index, payload in enumerate(payloads):
                names.update(item.name for item in payload.items)
                stats["payloads"] += 1
                stats["changed_elements"] += payload.changed_elements
                stats["wire_bytes"] += payload.nbytes
                stats["dense_bytes"] += payload.dense_bytes
                in_flight.append(
                    pool.submit(
                        client.send_payload,
                        transfer_id=transfer_id,
                        payload_id=f"{payload_prefix}.{index}",
                        checksum=payload.checksum,
                        verification_candidates=verification_candidates,
                        body=payload,
                        relay_root=relay_root,
                        base_version=base_version,
                        target_version=target_version,
                        deadline=deadline,
                    )
                )
                while len(in_flight) >= senders:
                    in_flight.popleft().result()
            while in_flight:
                in_flight.popleft().result()
    except RefitError as error:
        if total_dense_bytes:
            error.progress = min(1.0, stats["dense_bytes"] / total_dense_bytes)
        raise
    stats["tensors"] = len(names)
    return stats


def _watched(
    tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
    deadline: Deadline,
    stop: threading.Event,
) -> Iterator[NamedTensor]:
    """``tensors``, ending the encoding (which aborts its refit) once the deadline passed or
    a newer refit took the tracker over: a starved encoder must not run on unseen."""
    if isinstance(tensors, Mapping):
        tensors = (NamedTensor(name, tensor) for name, tensor in tensors.items())
    source = iter(tensors)
    try:
        for named in source:
            if stop.is_set():
                raise RefitAbortedError("a newer refit took this producer's tracker over")
            deadline.check(f"encoding {named.name}")
            yield named
    finally:
        _close(source)  # the source's own generator ends with the stream, not at collection


def _close(generator: Iterator[object]) -> None:
    """Close a generator now, not at garbage collection (the tracker's encoding would then
    abort whatever refit the tracker has pending by then)."""
    close = getattr(generator, "close", None)
    if callable(close):
        close()
