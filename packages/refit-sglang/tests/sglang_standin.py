"""A stand-in SGLang engine: SGLang's refit routes and request bodies over reference engines.

SGLang cannot run on these CPU machines, so tests refit this instead. Every request body is
checked against SGLang's request structs (:func:`refit_sglang.validate_request`, which also
refuses unknown fields) before it is served; a payload is rebuilt the way SGLang rebuilds a
flattened bucket (base64 -> unpickle -> ``metadata`` attributes -> views) by each rank from its
own entry. Reachable over HTTP (:func:`serve`) or in process
(:mod:`sglang_engine_standin`, shaped like ``sglang.Engine``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import pickle
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from refit_core.backend import Deadline
from refit_lab.conformance import RefitDeployment
from refit_lab.faults import fault_self
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_nccl.backend import AbortableProcessGroup, GroupSpec
from refit_sglang.protocol import validate_request

logger = logging.getLogger(__name__)


@dataclass
class StandInSGLang:
    """One SGLang server with ``tp_size`` ranks, each a reference engine on the full weights.

    Attributes:
        calls: ``(route, body)`` of every valid request, payloads left out.
        hang_on: a route that, once ``hang_s`` is set, sleeps that long before answering.
    """

    config: ReferenceModelConfig
    seed: int
    tp_size: int = 1
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    hang_on: str | None = None
    hang_s: float = 0.0
    paused: bool = False
    collective_timeout_s: float = 20.0
    """Bound of its own collective calls (real SGLang's is its NCCL timeout, 10+ minutes)."""

    def __post_init__(self) -> None:
        self.ranks = [ReferenceEngine(self.config, seed=self.seed) for _ in range(self.tp_size)]
        self.weight_version: str | None = None
        self.groups: dict[str, list[AbortableProcessGroup]] = {}
        self._lock = threading.Lock()

    def handle(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve ``route``: ``{"success", "message"}`` (ValueError for an invalid body)."""
        validate_request(route, body)
        with self._lock:
            self.calls.append(
                (route, {k: v for k, v in body.items() if k != "serialized_named_tensors"})
            )
        if route == self.hang_on and self.hang_s:
            time.sleep(self.hang_s)
        handler = getattr(self, f"_{route}")
        try:
            handler(**body)
        except Exception as exc:
            logger.warning("stand-in %s failed: %s", route, exc)
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        return {"success": True, "message": "Succeeded"}

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations from rank 0 (refused while paused)."""
        if self.paused:
            raise RuntimeError("generation is paused")
        return self.ranks[0].generate(prompts, max_new_tokens).tokens

    def _pause_generation(self, mode: str = "abort") -> None:
        if mode == "in_place":
            logger.warning("stand-in paused in place: KV from old weights survives")
        self.paused = True

    def _continue_generation(self, torch_empty_cache: bool = True) -> None:
        self.paused = False

    def _flush_cache(self, timeout_s: float | None = None) -> None:
        for rank in self.ranks:
            rank.reset_prefix_cache()

    def _update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str | bytes],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        **_: object,
    ) -> None:
        if load_format != "flattened_bucket":
            raise ValueError(
                f"the stand-in serves load_format='flattened_bucket', not {load_format!r}"
            )
        if len(serialized_named_tensors) != self.tp_size:
            raise ValueError(f"{len(serialized_named_tensors)} payloads for {self.tp_size} ranks")
        for rank, payload in zip(self.ranks, serialized_named_tensors, strict=True):
            raw = base64.b64decode(payload) if isinstance(payload, str) else payload
            bucket = pickle.loads(raw)
            flat: torch.Tensor = bucket["flattened_tensor"]
            rank.load_weights(
                (m.name, flat[m.start_idx : m.end_idx].reshape(m.shape)) for m in bucket["metadata"]
            )
        self._commit(flush_cache, weight_version)

    def _init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        groups = [
            AbortableProcessGroup(
                GroupSpec(
                    master_address,
                    master_port,
                    rank_offset + tp_rank,
                    world_size,
                    backend,  # type: ignore[arg-type]
                    group_name,
                    self.collective_timeout_s,
                    rendezvous="sglang",  # the keys SGLang's init_custom_process_group uses
                )
            )
            for tp_rank in range(self.tp_size)
        ]
        deadline = Deadline.after(self.collective_timeout_s)
        joins = [threading.Thread(target=g.connect, args=(deadline,)) for g in groups]
        for join in joins:
            join.start()
        for join in joins:
            join.join()
        if not all(g.connected for g in groups):
            raise RuntimeError(f"not every rank joined {group_name}")
        self.groups[group_name] = groups

    def _update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        **_: object,
    ) -> None:
        groups = self.groups[group_name]
        received = [
            [
                (n, torch.empty(s, dtype=getattr(torch, d)))
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
            for _ in groups
        ]
        pending = [
            group.broadcast_async(tensor, 0, Deadline.never())
            for group, tensors in zip(groups, received, strict=True)
            for _, tensor in tensors
        ]
        for call in pending:
            call.wait()
        for rank, tensors in zip(self.ranks, received, strict=True):
            rank.load_weights(tensors)
        self._commit(flush_cache, weight_version)

    def _destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        for group in self.groups.pop(group_name):
            group.abort("destroyed")

    def _commit(self, flush_cache: bool, weight_version: str | None) -> None:
        if flush_cache:
            self._flush_cache()
        if weight_version is not None:
            for rank in self.ranks:
                rank.set_weight_version(int(weight_version))
            self.weight_version = weight_version


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path == "/get_server_info":
            self._reply(200, {"tp_size": self.server.engine.tp_size, "device": "cpu"})
        else:
            self._reply(404, {"message": f"no route {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            reply = self.server.engine.handle(self.path.lstrip("/"), body)
        except ValueError as exc:
            self._reply(400, {"success": False, "message": str(exc)})
            return
        self._reply(200 if reply["success"] else 400, reply)

    def _reply(self, status: int, content: dict[str, Any]) -> None:
        data = json.dumps(content).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (its timeout): nothing to answer

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug(format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, engine: StandInSGLang) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.engine = engine


@contextmanager
def serve(engine: StandInSGLang) -> Iterator[str]:
    """Serve ``engine`` over HTTP on 127.0.0.1 (an ephemeral port); yields its base URL."""
    server = _Server(engine)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name="sglang-standin",
        daemon=True,
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def serve_in_process(
    config: ReferenceModelConfig, seed: int, tp_size: int, die_on: str | None, results: Any
) -> None:
    """Process entry: serve a stand-in over HTTP, put its URL on ``results``, live until killed
    (or kill itself with SIGKILL as soon as route ``die_on`` is called)."""
    engine = StandInSGLang(config, seed, tp_size)
    if die_on is not None:
        setattr(engine, f"_{die_on}", lambda **_: fault_self(signal.SIGKILL))
    with serve(engine) as url:
        results.put(url)
        threading.Event().wait()


@dataclass
class StandInDeployment(RefitDeployment):
    """A trainer refitting stand-in engines; ``stack`` closes their HTTP servers."""

    engines: Sequence[StandInSGLang] = ()
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def engine_digests(self) -> list[dict[str, int]]:
        return [rank.state_digests() for engine in self.engines for rank in engine.ranks]

    def engine_versions(self) -> list[int]:
        return [rank.weight_version for engine in self.engines for rank in engine.ranks]

    def engine_generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[list[int]]]:
        return [
            rank.generate(prompts, max_new_tokens).tokens
            for engine in self.engines
            for rank in engine.ranks
        ]

    def close(self) -> None:
        super().close()
        self.stack.close()
