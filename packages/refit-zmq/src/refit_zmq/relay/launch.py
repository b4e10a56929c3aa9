"""A relay process over given tensors: what ``refit relay serve`` and
``python -m refit_zmq.relay serve`` run.

The receiver holds either a random state of given shapes (a stand-in engine, to stand a tree
up and try it) or the tensors of a safetensors file. Once the relay listens, the process
writes one JSON line to stdout (``{"address", "pid", "version"}``), logs to stderr, and
serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from refit_zmq.relay.apply.receiver import TensorReceiver
from refit_zmq.relay.node.server import ZmqSparseRefitServer
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["RelayProcess", "parse_shapes", "random_state", "read_safetensors"]

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 << 20

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def parse_shapes(spec: str) -> Shapes:
    """``"name=512x256:bfloat16,other=256:float32"`` -> name -> (shape, dtype).

    Raises:
        ValueError: a malformed entry or an unknown dtype.
    """
    shapes: Shapes = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = entry.partition("=")
        dims, _, dtype_name = rest.partition(":")
        dtype = getattr(torch, dtype_name or "float32", None)
        if not name or not dims or not isinstance(dtype, torch.dtype):
            raise ValueError(f"bad tensor spec {entry!r} (want name=DxD:dtype)")
        shapes[name] = (tuple(int(d) for d in dims.split("x")), dtype)
    if not shapes:
        raise ValueError("no tensors in the spec")
    return shapes


def random_state(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], seed: int
) -> dict[str, torch.Tensor]:
    """A deterministic random state of ``shapes``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, (shape, dtype) in shapes.items()
    }


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (its header, then the raw little-endian data).

    Raises:
        ValueError: not a safetensors file, or a dtype this reader does not know.
    """
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file")
    (length,) = struct.unpack_from("<Q", data)
    if length > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"{path}: header length {length} does not fit the file")
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has {end - start} bytes for {shape}")
        raw = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


@dataclass(frozen=True)
class RelayProcess:
    """One relay process: where it listens, its key and timeouts, its receiver's version.

    Attributes:
        bind_address: where the relay listens.
        version: the version the tensors hold (None: unknown, so only a resync applies).
        timeout_s: the relay's timeout (see :class:`~refit_zmq.relay.ZmqSparseRefitServer`).
        api_key_env_var: the environment variable holding the API key (None: no key).
        tuning: fan-out, chunk size, staging budget, heartbeats.
    """

    bind_address: str = "tcp://127.0.0.1:*"
    version: int | None = 0
    timeout_s: float = 30.0
    api_key_env_var: str | None = None
    tuning: RelayTuning = field(default_factory=RelayTuning)

    def serve(self, tensors: Mapping[str, torch.Tensor], out: TextIO) -> int:
        """Serve a relay over ``tensors`` until SIGTERM or SIGINT; announce it on ``out``."""
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        receiver = TensorReceiver(tensors, version=self.version)
        server = ZmqSparseRefitServer(
            receiver,
            bind_address=self.bind_address,
            api_key_env_var=self.api_key_env_var,
            timeout_s=self.timeout_s,
            tuning=self.tuning,
            curve=CurveConfig.from_env(),
        )
        with server:
            address = server.start()
            out.write(json.dumps({"address": address, "pid": os.getpid(), "version": self.version}))
            out.write("\n")
            out.flush()
            logger.info(
                "relay %s serving %d tensors at version %s", address, len(tensors), self.version
            )
            while not stop.wait(0.5):
                pass
        logger.info("relay %s stopped", address)
        return 0
