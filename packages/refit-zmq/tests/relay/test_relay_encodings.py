"""The encodings PROTOCOL.md states, computed in plain Python from its text and checked against
a relay: the tree id, the CURVE keys (Z85) and the digest's text (dtype and shape)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import xxhash
import zmq
from wire_helpers import PROTOCOL, Wire

from refit_zmq.relay import CurveConfig, TensorReceiver, ZmqSparseRefitServer

pytestmark = pytest.mark.timeout(60)


def test_the_tree_id_is_xxh3_64_of_the_fanout_and_the_relays_one_per_line(
    relay: tuple[ZmqSparseRefitServer, str], wire: Wire
) -> None:
    _, address = relay
    relays = [address, "tcp://127.0.0.1:9", "ipc:///tmp/relay-c"]
    done = wire.request("CONFIGURE", relays=relays, own_address=address, fanout=3)
    text = "\n".join(["3", *relays])
    assert done["result"]["tree"] == xxhash.xxh3_64(text.encode("utf-8")).hexdigest()


@pytest.fixture
def curve_keys(monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    """A server key pair as zmq.curve_keypair() gives it (40 Z85 characters each), in the
    variables relays read."""
    public, secret = zmq.curve_keypair()
    monkeypatch.setenv("REFIT_ZMQ_CURVE_PUBLIC_KEY", public.decode("ascii"))
    monkeypatch.setenv("REFIT_ZMQ_CURVE_SECRET_KEY", secret.decode("ascii"))
    return public, secret


def test_curve_keys_are_z85_text_and_a_plain_client_gets_through(
    curve_keys: tuple[bytes, bytes],
) -> None:
    server = ZmqSparseRefitServer(
        TensorReceiver({"w": torch.zeros(4)}, version=0),
        api_key_env_var=None,
        timeout_s=10.0,
        curve=CurveConfig.from_env(),
    )
    address = server.start()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.curve_serverkey = curve_keys[0]
    client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
    try:
        client.connect(address)
        header = json.dumps({"protocol": PROTOCOL, "kind": "STATUS", "request_id": "r"})
        client.send_multipart([header.encode(), b""])
        assert client.poll(10_000), "no answer over CURVE"
        reply = json.loads(client.recv_multipart()[0])
        assert (reply["kind"], reply["result"]["version"]) == ("DONE", 0)
    finally:
        client.close()
        context.term()
        server.close()


@pytest.fixture
def shaped() -> Iterator[tuple[ZmqSparseRefitServer, str, dict[str, torch.Tensor]]]:
    """A relay over tensors of 0, 1 and 2 dimensions."""
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "scalar": torch.tensor(-0.0),
        "norm": torch.randn(5, generator=generator),
        "embed": torch.randn(3, 4, generator=generator).to(torch.bfloat16),
    }
    server = ZmqSparseRefitServer(
        TensorReceiver(tensors, version=0), api_key_env_var=None, timeout_s=10.0
    )
    try:
        yield server, server.start(), tensors
    finally:
        server.close()


def _digest(dtype: str, shape: str, bits: bytes) -> int:
    """PROTOCOL.md's digest: xxh3-64 of ``"{dtype}|{shape}|"`` then the raw bits."""
    return xxhash.xxh3_64(f"{dtype}|{shape}|".encode() + bits).intdigest()


def test_digests_hash_the_dtype_and_the_shape_as_their_text_then_the_bits(
    shaped: tuple[ZmqSparseRefitServer, str, dict[str, torch.Tensor]],
) -> None:
    _, address, tensors = shaped
    with Wire(address) as wire:
        held = wire.request("STATUS", digests=True)["result"]["digests"]
    bits = {
        name: tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32)
        .numpy()
        .astype(np.dtype(f"<i{tensor.element_size()}"))
        .tobytes()
        for name, tensor in tensors.items()
    }
    assert held == {
        "scalar": _digest("torch.float32", "()", bits["scalar"]),
        "norm": _digest("torch.float32", "(5,)", bits["norm"]),
        "embed": _digest("torch.bfloat16", "(3, 4)", bits["embed"]),
    }
