"""How a load's payloads reach the engine's workers: in shared memory, or in the RPC itself.

A ``vllm.LLM`` or ``AsyncLLM`` runs its engine core and workers on the host of the process
that holds it, so by default the controller writes the payloads once into a memfd
(:class:`~refit_zmq.ipc.shm.ShmBuffer`) and the RPC carries its handle: every worker maps it
and reads the payloads in place. Engines whose workers run on other hosts (vLLM's Ray
executor) take the payloads inline, as bytes in the RPC message (copied by vLLM on each hop).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from refit_core import ProtocolError
from refit_zmq.codec.format import BytesLike
from refit_zmq.ipc.handles import handle_from_json
from refit_zmq.ipc.shm import ShmBuffer, ShmHandle, attach_shm

__all__ = ["carried", "opened"]


@contextmanager
def carried(payloads: Sequence[bytes], *, shared_memory: bool) -> Iterator[dict[str, Any]]:
    """The payloads as an RPC carries them, valid until the context ends."""
    if not shared_memory:
        yield {"inline": list(payloads)}
        return
    buffer = ShmBuffer(max(1, sum(len(p) for p in payloads)))
    try:
        spans, at, memory = [], 0, buffer.tensor.numpy()
        for payload in payloads:
            memory[at : at + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            spans.append([at, len(payload)])
            at += len(payload)
        yield {"shm": buffer.handle.to_json(), "spans": spans}
    finally:
        buffer.close()


def opened(carrier: Mapping[str, Any]) -> list[BytesLike]:
    """The payloads :func:`carried` wrote, read in place where they are in shared memory.

    Raises:
        ProtocolError: a malformed carrier, or shared memory this process cannot map.
    """
    if "inline" in carrier:
        return [bytes(p) for p in carrier["inline"]]
    handle = handle_from_json(carrier.get("shm"))
    if not isinstance(handle, ShmHandle):
        raise ProtocolError("adapter payloads travel in host shared memory only")
    mapping = memoryview(attach_shm(handle).numpy().data)
    try:
        return [
            mapping[int(start) : int(start) + int(length)] for start, length in carrier["spans"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed payload spans: {exc}") from exc
