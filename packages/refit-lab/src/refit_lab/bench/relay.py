"""Bench `relay`: the transactional ZeroMQ relay tree against raw pyzmq, loopback and shaped.

Loopback (always): dense-resync payloads (quick 64 MiB, full 1 GiB of bf16 weights; encoded
uncompressed before the clock starts, so the wire carries the dense bytes; 16 MiB payloads in
4 MiB chunks) pushed through one relay in a child process that verifies every checksum and
applies them as they arrive, with undo data, into a reference engine's real parameters until
the transfer is committed, each right after one round of the harness's raw pyzmq stream of the
same bytes (1 MiB frames) to a receiver process of its own; then a 1%-changed refit (AdamW-like,
calibrated; encoding included), which is bound by the scattered writes of apply rather than
by the wire. ``relays_apply_s`` is the receivers' apply time, summed over relays.
The raw stream's CPU seconds (both processes, every thread) plus the least work a
transactional receiver adds to them (xxh3 of every byte and the copy of the bits it overwrites
into warm undo memory; in process, no network) give ``transport_efficiency_cpu_bound``: the
most any relay could reach on this machine if all that work were spread perfectly over its
cores. The ceiling is also measured: before each raw round, the same raw stream to a receiver
that does exactly that work on every frame (received without a copy, hashed, its old bits
kept, written; the digest checked per round) and nothing else; ``ceiling_vs_raw_zmq`` is
what it reaches, ``transport_efficiency_vs_ceiling`` how close the relay gets to it.

Shaped (root only; skipped otherwise): hosts in network namespaces joined by veth pairs to
one bridge, every host's egress shaped with exactly ``tc qdisc add dev <veth> root tbf rate
500mbit burst 256kb latency 100ms`` (producer, relays and raw receivers alike). Cases: a raw
pyzmq transfer of the dense bytes to one host; the 1%-changed refit through one relay,
encoding included; dense resyncs to 1, 2, 4 and 8 receivers through relays chained with
fan-out 1 (a pipelined chain: every link carries each byte once), sent uncompressed (every
receiver would otherwise decompress: nine processes' worth of zstd on two shared cores made
the 8-receiver chain CPU-bound), against a star of raw pyzmq streams from the producer to
each receiver. Each host's veth byte counters are reported (tree and star together).
Every timed refit ends committed, and every receiver is checked bit for bit at the end.

Every refit-against-raw ratio is interleaved: the raw round (from the producer's own process
and host) runs right before each refit, and the summary gives the median of the per-round
ratios with the raw reference's own median rate beside it (``<ratio>_reference_gbps``). The
8-vs-1 time ratios compare a case with itself at two sizes (separate runs, link-bound).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing.connection
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from refit_core import WeightVersion
from refit_core.backend import Deadline as RefitDeadline
from refit_core.backend import LocalParticipant, Participant
from refit_core.sources import StateDictSource
from refit_lab.bench.deltas import Trajectory, calibrate_lr
from refit_lab.bench.harness import (
    BenchContext,
    BenchReport,
    PairedRatio,
    gbps,
    machine_info,
    rate_fields,
)
from refit_lab.bench.raw_zmq import LoopbackStream, ZmqStreamSender, summarize, zmq_receiver
from refit_lab.bench.references import MiB
from refit_lab.bench.runtime import ChildGroup, Deadline
from refit_lab.pytest_plugin import netns_available
from refit_lab.reference_engine import (
    ReferenceEngine,
    ReferenceModelConfig,
    checkpoint_tensor_specs,
)
from refit_zmq.codec import tensor_digest
from refit_zmq.relay import (
    RelayCoordinator,
    RelayStatus,
    RelayTuning,
    ShardProducer,
    ShardProducerRole,
    TransferOptions,
    ZmqSparseRefitClient,
    deliver_payloads,
    new_transfer_id,
    run_transfer,
)
from refit_zmq.sparse import EngineRelay
from refit_zmq.tracker import DeltaCompressionTracker, TrackerConfig

logger = logging.getLogger(__name__)

GiB = 1024 * MiB
CHANGED_FRACTION = 0.01
RECEIVERS = (1, 2, 4, 8)
SHAPING = ("tbf", "rate", "500mbit", "burst", "256kb", "latency", "100ms")
CHUNK_BYTES = MiB
BUCKET_BYTES = 8 * MiB
TUNING = RelayTuning(chunk_bytes=CHUNK_BYTES, max_inflight_bytes=4 * BUCKET_BYTES, fanout=1)
LOOPBACK_BUCKET_BYTES = 16 * MiB
LOOPBACK_TUNING = RelayTuning(
    chunk_bytes=4 * MiB, max_inflight_bytes=2 * LOOPBACK_BUCKET_BYTES, fanout=1
)
"""Loopback: fewer, larger chunks and payloads (fewer Python hand-offs per byte; the raw
stream keeps 1 MiB frames, its fastest here: 0.109 s per 256 MiB against 0.170 s with 4 MiB
frames). Shaped links keep 1 MiB chunks: every hop of the chain adds a chunk's latency."""
_CLONE_NEWNET = 0x40000000
_SUBNET = "10.77.0"
_RAW_PORT = 6000
_CMD_TIMEOUT_S = 20.0

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """Sizes of the bench: state bytes per part, repeats, receiver counts, model width."""

    dense_bytes: int
    tree_bytes: int
    repeats: int
    receivers: tuple[int, ...] = RECEIVERS
    hidden: int = 1024


QUICK = Sizes(dense_bytes=64 * MiB, tree_bytes=64 * MiB, repeats=2)
FULL = Sizes(dense_bytes=1 * GiB, tree_bytes=256 * MiB, repeats=3)


# -- the state: a reference engine's checkpoint, and an AdamW-like step of it ---------------


def engine_config(target_bytes: int, hidden: int = 1024) -> ReferenceModelConfig:
    """A bf16 reference model of at least ``target_bytes``, ``hidden`` wide (one layer of
    width 1024 is 64 MiB; layers are added until the model fits)."""
    heads = max(1, hidden // 64)
    for layers in range(1, 4096):
        config = ReferenceModelConfig(
            vocab_size=17 * hidden // 2,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
            intermediate_size=4 * hidden,
            max_seq_len=64,
        )
        if state_bytes(config) >= target_bytes:
            return config
    raise ValueError(f"no reference model of {target_bytes} bytes")


def state_bytes(config: ReferenceModelConfig) -> int:
    """Bytes of the model's checkpoint."""
    return sum(2 * math.prod(shape) for shape, _ in checkpoint_tensor_specs(config).values())


def _draw(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 master (normal 0.02; norms near 1) and an AdamW-like step direction."""
    noise = torch.randn(shape, generator=generator)
    master = 1.0 + 0.01 * noise if len(shape) == 1 else 0.02 * noise
    step = torch.randn(shape, generator=generator).sign_().mul_(1e-3).add_(master, alpha=0.01)
    return master, step


def states(config: ReferenceModelConfig, seed: int) -> tuple[State, State]:
    """The bf16 weights before and after a step that changes about 1% of them.

    The learning rate is calibrated on a sample drawn alike (at most 64 rows per matrix);
    the weights are then drawn one tensor at a time, so fp32 copies never pile up.
    """
    specs = checkpoint_tensor_specs(config)
    sampler = torch.Generator().manual_seed(seed + 1)
    sample = {
        name: _draw((min(shape[0], 64), *shape[1:]) if len(shape) > 1 else shape, sampler)
        for name, (shape, _) in specs.items()
    }
    path = Trajectory(
        {n: m for n, (m, _) in sample.items()}, {n: d for n, (_, d) in sample.items()}
    )
    lr = calibrate_lr(path, CHANGED_FRACTION)
    generator = torch.Generator().manual_seed(seed)
    before: State = {}
    after: State = {}
    for name, (shape, _) in specs.items():
        master, step = _draw(shape, generator)
        before[name] = master.to(torch.bfloat16)
        after[name] = master.sub_(step, alpha=lr).to(torch.bfloat16)
    return before, after


def digests(state: State) -> dict[str, int]:
    """Per-tensor bitwise digests."""
    return {name: tensor_digest(tensor) for name, tensor in state.items()}


# -- network namespaces ----------------------------------------------------------------------


def _ip(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)


class ShapedLan:
    """``hosts`` network namespaces on one bridge, each host's egress shaped (root only).

    Only namespaces, links and addresses made here are touched; all of them are removed on
    exit, whatever happened.
    """

    def __init__(self, hosts: int) -> None:
        tag = f"rzb{os.getpid() % 100000}"
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}n{i}" for i in range(hosts)]
        self.outer = [f"{tag}h{i}" for i in range(hosts)]
        self.ips = [f"{_SUBNET}.{i + 1}" for i in range(hosts)]
        self._made: list[Callable[[], None]] = []

    def __enter__(self) -> ShapedLan:
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(lambda: _ip("ip", "link", "del", self.bridge))
            _ip("ip", "link", "set", self.bridge, "up")
            for index, (ns, outer) in enumerate(zip(self.namespaces, self.outer, strict=True)):
                self._host(index, ns, outer)
        except BaseException:
            self.close()
            raise
        logger.info("shaped LAN of %d hosts on %s", len(self.namespaces), self.bridge)
        return self

    def _host(self, index: int, ns: str, outer: str) -> None:
        inner = f"{outer}x"
        _ip("ip", "netns", "add", ns)
        self._made.append(lambda: _ip("ip", "netns", "del", ns))
        _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        self._made.append(lambda: _ip("ip", "link", "del", outer))
        _ip("ip", "link", "set", inner, "netns", ns)
        _ip("ip", "link", "set", outer, "master", self.bridge, "up")
        for command in (
            ("ip", "addr", "add", f"{self.ips[index]}/24", "dev", inner),
            ("ip", "link", "set", inner, "up"),
            ("ip", "link", "set", "lo", "up"),
            ("tc", "qdisc", "add", "dev", inner, "root", *SHAPING),
        ):
            _ip("ip", "netns", "exec", ns, *command)

    def counters(self) -> list[dict[str, int]]:
        """Per host: bytes it sent and received through its veth (read on the bridge side)."""
        out = []
        for outer in self.outer:
            stats = f"/sys/class/net/{outer}/statistics"
            with open(f"{stats}/rx_bytes") as sent, open(f"{stats}/tx_bytes") as received:
                out.append({"sent": int(sent.read()), "received": int(received.read())})
        return out

    def close(self) -> None:
        """Remove everything made, newest first."""
        while self._made:
            undo = self._made.pop()
            try:
                undo()
            except (subprocess.SubprocessError, OSError) as exc:
                logger.warning("cleanup step failed: %s", exc)

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def enter_netns(name: str | None) -> None:
    """Move the calling thread (and every thread it starts later) into namespace ``name``."""
    if name is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({name}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def _in_netns(name: str | None, target: Callable[..., Any], *args: Any) -> Any:
    """Child entry: enter ``name``, then run ``target(*args)``."""
    enter_netns(name)
    torch.set_num_threads(1)
    return target(*args)


# -- relays and producers ---------------------------------------------------------------------


def serve_relay(
    conn: multiprocessing.connection.Connection,
    bind_ip: str,
    config: ReferenceModelConfig,
    timeout_s: float,
    tuning: RelayTuning,
) -> None:
    """Child: a relay in front of a reference engine; send its address, serve until told."""
    engine = ReferenceEngine(config)
    relay = EngineRelay(
        engine, bind_address=f"tcp://{bind_ip}:*", timeout_s=timeout_s, tuning=tuning
    )
    conn.send(relay.start())
    with contextlib.suppress(EOFError):
        conn.recv()
    relay.close()


@contextlib.contextmanager
def relays(
    netns: Sequence[str | None],
    ips: Sequence[str],
    config: ReferenceModelConfig,
    deadline: Deadline,
    tuning: RelayTuning = TUNING,
) -> Iterator[list[str]]:
    """Relays in child processes (one per namespace); their addresses."""
    pipes = [multiprocessing.Pipe() for _ in netns]
    args = [
        (ns, serve_relay, child, ip, config, 30.0, tuning)
        for ns, ip, (_, child) in zip(netns, ips, pipes, strict=True)
    ]
    with ChildGroup(_in_netns, args, deadline=deadline, name="relay") as group:
        addresses = []
        for parent, _ in pipes:
            while not parent.poll(0.1):
                deadline.check()
                group.poll()
            addresses.append(parent.recv())
        try:
            yield addresses
        finally:
            for parent, _ in pipes:
                with contextlib.suppress(OSError):
                    parent.send("stop")


@dataclass(frozen=True)
class Step:
    """One timed refit: its case, which state it sends, whether densely, whether it is
    encoded before the clock starts (a transport measurement) or while sending, and whether
    one round of the raw reference runs right before it (its seconds go in the row as
    ``reference_s``)."""

    case: str
    state: str
    resync: bool
    pre_encoded: bool = False
    paired: bool = False


@dataclass(frozen=True)
class StarReference:
    """Raw pyzmq streams of ``nbytes`` from the producer's host ``ip`` to ``receivers``
    :func:`~refit_lab.bench.raw_zmq.zmq_receiver` children (already started, connecting to
    the fixed ports), one round before every paired step; picklable, so a producer in
    another process makes its own sender."""

    ip: str
    receivers: int
    nbytes: int
    timeout_s: float

    def sender(self) -> ZmqStreamSender:
        """The bound sender (wait for :meth:`ZmqStreamSender.ready` before its rounds)."""
        return ZmqStreamSender(
            self.nbytes,
            receivers=self.receivers,
            chunk_bytes=CHUNK_BYTES,
            ip=self.ip,
            ports=(_RAW_PORT, _RAW_PORT + 100),
            deadline=Deadline(self.timeout_s, "raw star sender"),
        )


@dataclass(frozen=True)
class Producing:
    """How the producer encodes (payload size, compression) and sends (the relays' tuning)."""

    bucket_bytes: int = BUCKET_BYTES
    compress: bool = True
    threads: int = 1
    tuning: RelayTuning = TUNING


class _Weights:
    """The producer's trainer: whichever state the current step sends."""

    def __init__(self, state: State) -> None:
        self.state = state

    def weight_source(self) -> StateDictSource:
        return StateDictSource(self.state)


_UNBOUNDED = RefitDeadline.never()
"""The relays' calls wait their attempts of ``timeout_s``; the bench's own deadline (its
child group) bounds the whole run."""


def _timed_refit(
    coordinator: RelayCoordinator,
    producer: Participant[ShardProducerRole],
    tracker: DeltaCompressionTracker,
    client: ZmqSparseRefitClient,
    version: int,
    step: Step,
    state: State,
    tuning: RelayTuning,
) -> dict[str, Any]:
    """One committed refit; its timing and sizes."""
    options = TransferOptions(None, 60.0, tuning, verification_candidates=0)
    if not step.pre_encoded:
        started = time.perf_counter()
        result = run_transfer(
            coordinator,
            [producer],
            target_version=version,
            resync=step.resync,
            options=options,
            deadline=_UNBOUNDED,
        )
        seconds = time.perf_counter() - started
        applying = sum(r.apply_s for r in result.outcome.reports.values())
        return {
            "seconds": seconds,
            "stream_s": result.stream_s,
            "finish_s": result.finish_s,
            "relays_apply_s": applying,
            **result.shards[0],
        }
    base = tracker.version
    payloads = list(tracker.encode(state, WeightVersion(version), resync=step.resync))
    transfer_id = new_transfer_id(version)
    started = time.perf_counter()
    stats = deliver_payloads(
        payloads,
        client,
        transfer_id=transfer_id,
        payload_prefix="0",
        relay_root=None,
        base_version=None if step.resync or base is None else base.value,
        target_version=version,
        verification_candidates=0,
        senders=tuning.window_payloads,
        deadline=_UNBOUNDED,
    )
    streamed = time.perf_counter()
    outcome = coordinator.finish(transfer_id, stats["payloads"], deadline=_UNBOUNDED)
    seconds = time.perf_counter() - started
    if not outcome.committed:
        tracker.abort()
        raise outcome.error({a: i for i, a in enumerate(coordinator.relays)}, target=version)
    tracker.commit()
    applying = sum(r.apply_s for r in outcome.reports.values())
    return {
        "seconds": seconds,
        "stream_s": streamed - started,
        "finish_s": seconds - (streamed - started),
        "relays_apply_s": applying,
        **stats,
    }


def _star_rounds(stack: contextlib.ExitStack, reference: StarReference) -> Callable[[], float]:
    """A ready star sender (closed with ``stack``) as a callable timing one round."""
    star = stack.enter_context(reference.sender())
    star.ready()
    return lambda: star.round()[0]


def produce(
    addresses: Sequence[str],
    config: ReferenceModelConfig,
    steps: Sequence[Step],
    producing: Producing,
    seed: int = 0,
    reference: StarReference | Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Run ``steps`` (each committed) into the relays, rooted at the first; rows, and whether
    every relay ends bit-exact with the last state. Runs in the caller's network namespace.
    Before every paired step one round of ``reference`` runs (a star's own sender, made
    here, or a callable returning seconds)."""
    base, new = states(config, seed)
    by_name = {"base": base, "new": new}
    weights = _Weights(base)
    shard = ShardProducer(weights)
    shard.refit_init(
        TrackerConfig(
            bucket_size_bytes=producing.bucket_bytes,
            max_item_bytes=producing.bucket_bytes // 2,
            threads=producing.threads,
            compress=producing.compress,
        )
    )
    producer = LocalParticipant[ShardProducerRole](shard, "producer 0")
    tuning = producing.tuning
    coordinator = RelayCoordinator(api_key=None, timeout_s=60.0, tuning=tuning)
    client = ZmqSparseRefitClient(
        addresses[0], timeout_s=60.0, producer_id="shard-0", retries=tuning.retries, tuning=tuning
    )
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(producer.close)
        stack.callback(shard.refit_close)
        stack.callback(coordinator.close)
        stack.callback(client.close)
        raw_round = (
            _star_rounds(stack, reference) if isinstance(reference, StarReference) else reference
        )
        coordinator.configure_tree(list(addresses), deadline=_UNBOUNDED)
        for version, step in enumerate(steps, start=1):
            paired = {}
            if step.paired and raw_round is not None:
                paired["reference_s"] = raw_round()
            weights.state = by_name[step.state]
            timed = _timed_refit(
                coordinator, producer, shard.tracker, client, version, step, weights.state, tuning
            )
            rows.append({"case": step.case, **timed, **paired})
        expected = digests(by_name[steps[-1].state])
        held = coordinator.status(digests=True, deadline=_UNBOUNDED)
        exact = all(isinstance(s, RelayStatus) and s.digests == expected for s in held.values())
    return {"rows": rows, "bitexact": exact}


def _median_rows(rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One result row from the timed repeats of a case (median seconds, the dense bytes'
    rate in each round and its median)."""
    seconds = [float(r["seconds"]) for r in rows]
    row = {**rows[0], **extra, "seconds": statistics.median(seconds), "repeats": len(rows)}
    row.pop("reference_s", None)
    row.update(rate_fields("gbps_dense", [gbps(row["dense_bytes"], s) for s in seconds]))
    return row


def _paired(rows: list[dict[str, Any]], nbytes: int) -> PairedRatio:
    """The rows' refits (subject, at ``nbytes``: the dense bytes they bring the receivers
    to) against the raw rounds run right before each (the reference)."""
    return PairedRatio.of(
        subject_s=[float(r["seconds"]) for r in rows],
        reference_s=[float(r["reference_s"]) for r in rows],
        nbytes=nbytes,
    )


# -- loopback --------------------------------------------------------------------------------


def loopback(
    ctx: BenchContext, sizes: Sizes
) -> tuple[list[dict[str, Any]], dict[str, float | bool]]:
    """Dense and 1%-changed refits through one loopback relay, each dense refit right after a
    raw pyzmq stream of the same bytes (interleaved rounds)."""
    config = engine_config(sizes.dense_bytes, sizes.hidden)
    nbytes = state_bytes(config)
    repeats = sizes.repeats
    dense = [
        Step("loopback_dense", "base", True, pre_encoded=True, paired=True)
        for _ in range(repeats + 1)
    ]
    sparse = [Step("loopback_sparse_1pct", s, False) for s in ("new", "base") * repeats]
    deadline = Deadline(600 + nbytes / 20e6 * (3 * repeats + 3), "relay bench (loopback)")
    ctx.progress(f"loopback: {len(dense)} dense refits and raw streams, {len(sparse)} sparse", 0.0)
    producing = Producing(
        bucket_bytes=LOOPBACK_BUCKET_BYTES,
        compress=False,
        threads=ctx.threads,
        tuning=LOOPBACK_TUNING,
    )
    rounds = len(dense)
    ceiling_s: list[float] = []
    with (
        relays([None], ["127.0.0.1"], config, deadline, LOOPBACK_TUNING) as addresses,
        LoopbackStream(nbytes, rounds=rounds, chunk_bytes=CHUNK_BYTES) as stream,
        LoopbackStream(
            nbytes, rounds=rounds, chunk_bytes=CHUNK_BYTES, transactional=True
        ) as ceiling,
    ):

        def references() -> float:
            """The ceiling's round, then the raw round (right before the refit)."""
            ceiling_s.append(ceiling.round())
            return stream.round()

        produced = produce(addresses, config, [*dense, *sparse], producing, reference=references)
        receiver_cpu = stream.receiver_cpu_s()
        ceiling.receiver_cpu_s()
    raw_stream = summarize(stream, receiver_cpu, skip=1)
    ctx.progress("loopback: the least work a transactional receiver adds", 0.75)
    work_s = receiver_extra_s(config, repeats)
    rows = produced["rows"]
    timed_dense = rows[1 : repeats + 1]  # the first resync (and raw round) warms up
    ours = _median_rows(timed_dense)
    sparse_row = _median_rows(rows[repeats + 1 :])
    dense_s = [float(r["seconds"]) for r in timed_dense]
    raw_s = [float(r["reference_s"]) for r in timed_dense]
    bare_s = ceiling_s[1:]
    raw = _stream_row("loopback_raw_zmq", nbytes, raw_s, cpu_s=raw_stream.cpu_s)
    bare = _stream_row("loopback_transactional_zmq", nbytes, bare_s)
    work = {"case": "loopback_receiver_extra", "dense_bytes": nbytes, "seconds": work_s}
    work.update(cpu_s=work_s, repeats=repeats)
    cores = len(os.sched_getaffinity(0))
    bound_s = max(raw_stream.seconds, (raw_stream.cpu_s + work_s) / cores)
    results = [ours, sparse_row, raw, bare, work]
    summary: dict[str, float | bool] = {
        **_ratio(dense_s, raw_s, nbytes).summary("transport_efficiency_vs_raw_zmq"),
        **_ratio(bare_s, raw_s, nbytes).summary("ceiling_vs_raw_zmq"),
        **_ratio(dense_s, bare_s, nbytes).summary("transport_efficiency_vs_ceiling"),
        "transport_efficiency_cpu_bound": raw_stream.seconds / bound_s,
        "loopback_sparse_1pct_gbps_dense": sparse_row["gbps_dense"],
        "loopback_bitexact": produced["bitexact"],
    }
    return results, summary


def _stream_row(case: str, nbytes: int, round_s: list[float], **extra: Any) -> dict[str, Any]:
    """A reference stream's row: its median seconds and its rate in each round (paired with
    the refits')."""
    row = {"case": case, "dense_bytes": nbytes, "wire_bytes": nbytes}
    row.update(seconds=statistics.median(round_s), repeats=len(round_s))
    row.update(rate_fields("gbps_dense", [gbps(nbytes, s) for s in round_s]))
    return {**row, **extra}


def _ratio(subject_s: list[float], reference_s: list[float], nbytes: int) -> PairedRatio:
    return PairedRatio.of(subject_s=subject_s, reference_s=reference_s, nbytes=nbytes)


def receiver_extra_s(config: ReferenceModelConfig, repeats: int) -> float:
    """CPU seconds of the least work a transactional receiver adds to a raw stream's receiver,
    without network: xxh3 of every new byte and the copy of the bits it overwrites into warm
    undo memory, 1 MiB at a time with numpy over a reference engine's parameters. (Writing the
    new bytes into the parameters replaces the raw receiver's own copy out of the frame.)
    Median of ``repeats`` after a warm-up."""
    engine = ReferenceEngine(config)
    params = [
        t.detach().view(torch.uint8).view(-1).numpy() for t in engine.checkpoint_tensors().values()
    ]
    new = [p.copy() for p in params]
    undo = [np.full_like(p, 0) for p in params]  # written once here: warm, as a reused arena
    seconds = []
    for _ in range(repeats + 1):
        started = time.process_time()
        for param, fresh, kept in zip(params, new, undo, strict=True):
            for at in range(0, param.size, CHUNK_BYTES):
                chunk = slice(at, at + CHUNK_BYTES)
                xxhash.xxh3_128(fresh[chunk].data)
                kept[chunk] = param[chunk]
        seconds.append(time.process_time() - started)
    return statistics.median(seconds[1:])


# -- shaped links ----------------------------------------------------------------------------


@contextlib.contextmanager
def raw_receivers(
    lan: ShapedLan, receivers: int, nbytes: int, rounds: int, deadline: Deadline
) -> Iterator[ChildGroup[Any]]:
    """Raw pyzmq receivers on hosts 1..``receivers``, connecting to a :class:`StarReference`
    sender on host 0, for ``rounds`` rounds."""
    producer_ip = lan.ips[0]
    args = [
        (
            lan.namespaces[i],
            zmq_receiver,
            f"tcp://{producer_ip}:{_RAW_PORT + i - 1}",
            f"tcp://{producer_ip}:{_RAW_PORT + 99 + i}",
            nbytes,
            CHUNK_BYTES,
            rounds,
            deadline.remaining_s(),
        )
        for i in range(1, receivers + 1)
    ]
    with ChildGroup(_in_netns, args, deadline=deadline, name="raw-receiver") as group:
        yield group
        group.results()


def _traffic(lan: ShapedLan, before: list[dict[str, int]], hosts: int) -> list[dict[str, int]]:
    return [
        {k: after[k] - b[k] for k in after}
        for after, b in zip(lan.counters()[: hosts + 1], before, strict=False)
    ]


def shaped(ctx: BenchContext, sizes: Sizes) -> tuple[list[dict[str, Any]], dict[str, float | bool]]:
    """The shaped-link cases (see the module docstring); every refit is paired with a raw
    round run right before it on the same links."""
    hosts = 1 + max(sizes.receivers)
    dense_config = engine_config(sizes.dense_bytes, sizes.hidden)
    tree_config = engine_config(sizes.tree_bytes, sizes.hidden)
    dense_bytes, tree_bytes = state_bytes(dense_config), state_bytes(tree_config)
    link_s = 8 * (dense_bytes + sum(sizes.receivers) * 2 * tree_bytes) / 500e6
    deadline = Deadline(900 + 4 * sizes.repeats * link_s, "relay bench (shaped)")
    rows: list[dict[str, Any]] = []
    pairs: dict[str, PairedRatio] = {}
    exact = True
    with ShapedLan(hosts) as lan:
        ctx.progress("shaped: 1%-changed refits through one relay, raw dense transfers", 0.05)
        steps = [Step("resync", "base", True, paired=True)] + [
            Step("shaped_sparse_1pct", s, False, paired=True)
            for s in ("new", "base") * sizes.repeats
        ]
        star = StarReference(lan.ips[0], 1, dense_bytes, deadline.remaining_s())
        with raw_receivers(lan, 1, dense_bytes, len(steps), deadline):
            produced = _produce_in(
                lan, 1, dense_config, steps, Producing(threads=ctx.threads), deadline, star
            )
        timed = produced["rows"][1:]
        sparse = pairs["shaped_sparse_speedup_vs_dense"] = _paired(timed, dense_bytes)
        raw_s = statistics.median(float(r["reference_s"]) for r in timed)
        rows.append(
            {
                "case": "shaped_raw_dense",
                "receivers": 1,
                "seconds": raw_s,
                "dense_bytes": dense_bytes,
                "wire_bytes": dense_bytes,
                **rate_fields("gbps_dense", sparse.reference_rounds_gbps),
            }
        )
        rows.append(_median_rows(timed, receivers=1))
        exact &= bool(produced["bitexact"])
        for done, receivers in enumerate(sizes.receivers):
            ctx.progress(
                f"shaped: {receivers} receivers, tree and star interleaved",
                0.25 + 0.7 * done / len(sizes.receivers),
            )
            before = lan.counters()[: receivers + 1]
            steps = [
                Step("shaped_tree_dense", "base", True, paired=True)
                for _ in range(sizes.repeats + 1)
            ]
            star = StarReference(lan.ips[0], receivers, tree_bytes, deadline.remaining_s())
            with raw_receivers(lan, receivers, tree_bytes, len(steps), deadline):
                produced = _produce_in(
                    lan,
                    receivers,
                    tree_config,
                    steps,
                    Producing(compress=False, threads=ctx.threads),
                    deadline,
                    star,
                )
            traffic = _traffic(lan, before, receivers)
            timed = produced["rows"][1:]
            star_s = [float(r["reference_s"]) for r in timed]
            tree = pairs[f"tree_vs_star_{receivers}"] = _paired(timed, tree_bytes)
            exact &= bool(produced["bitexact"])
            rows.append(_median_rows(timed, receivers=receivers, veth_bytes_tree_and_star=traffic))
            rows.append(
                {
                    "case": "shaped_star_dense",
                    "receivers": receivers,
                    "seconds": statistics.median(star_s),
                    "dense_bytes": tree_bytes,
                    "wire_bytes": receivers * tree_bytes,
                    **rate_fields("gbps_dense", tree.reference_rounds_gbps),
                    "veth_bytes_tree_and_star": traffic,
                }
            )
    return rows, _shaped_summary(rows, pairs, exact)


def _produce_in(
    lan: ShapedLan,
    receivers: int,
    config: ReferenceModelConfig,
    steps: Sequence[Step],
    producing: Producing,
    deadline: Deadline,
    star: StarReference,
) -> dict[str, Any]:
    """Relays on hosts 1..``receivers`` (a chain rooted at host 1), the producer on host 0
    (which also sends the raw star's rounds)."""
    hosts = range(1, receivers + 1)
    netns = [lan.namespaces[i] for i in hosts]
    ips = [lan.ips[i] for i in hosts]
    with relays(netns, ips, config, deadline) as addresses:
        args = [(lan.namespaces[0], produce, addresses, config, steps, producing, 0, star)]
        with ChildGroup(_in_netns, args, deadline=deadline, name="producer") as producer:
            (produced,) = producer.results()
    result: dict[str, Any] = produced
    return result


def _shaped_summary(
    rows: list[dict[str, Any]], pairs: dict[str, PairedRatio], exact: bool
) -> dict[str, float | bool]:
    def seconds(case: str, receivers: int) -> float:
        return next(
            float(r["seconds"]) for r in rows if r["case"] == case and r["receivers"] == receivers
        )

    most = max(int(r["receivers"]) for r in rows)
    return {
        **pairs["shaped_sparse_speedup_vs_dense"].summary("shaped_sparse_speedup_vs_dense"),
        **pairs["tree_vs_star_1"].summary("shaped_tree1_vs_star1", time=True),
        f"shaped_tree_time_ratio_{most}_vs_1": seconds("shaped_tree_dense", most)
        / seconds("shaped_tree_dense", 1),
        f"shaped_star_time_ratio_{most}_vs_1": seconds("shaped_star_dense", most)
        / seconds("shaped_star_dense", 1),
        "shaped_bitexact": exact,
    }


# -- entry points ----------------------------------------------------------------------------


def measure(ctx: BenchContext, sizes: Sizes, *, shaped_links: bool | None = None) -> BenchReport:
    """Loopback always; shaped links when ``shaped_links`` (None: when namespaces can be made)."""
    rows, summary = loopback(ctx, sizes)
    reason = netns_available()
    if shaped_links is None:
        shaped_links = reason is None
    if shaped_links:
        shaped_rows, shaped_summary = shaped(ctx, sizes)
        rows += shaped_rows
        summary.update(shaped_summary)
    else:
        logger.warning("shaped-link cases skipped: %s", reason or "not asked for")
    summary["all_receivers_bitexact"] = bool(summary.pop("loopback_bitexact")) and bool(
        summary.pop("shaped_bitexact", True)
    )
    summary["shaped_measured"] = bool(shaped_links)
    ctx.progress("relay done", 1.0)
    return BenchReport(
        bench="relay", quick=ctx.quick, machine=machine_info(), results=rows, summary=summary
    )


def run(ctx: BenchContext) -> BenchReport:
    """The registered entry point: quick (64 MiB) or full (1 GiB dense, 256 MiB tree) sizes."""
    return measure(ctx, QUICK if ctx.quick else FULL)
