"""Hypothesis strategies of relay frame lists: random bytes, plausible headers, mutations."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import FIELDS, PROTOCOL, Kind, encode

_SIGNER = Signer(None)
_IDS = st.from_regex(r"[A-Za-z0-9_.:@/+-]{0,130}", fullmatch=True)
_ADDRESSES = st.sampled_from(["tcp://127.0.0.1:5555", "ipc:///tmp/x", "tcp://", "udp://x:1", ""])
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "checksum": st.from_regex(r"[0-9a-fA-F]{30,33}", fullmatch=True),
    "tree": st.from_regex(r"[0-9a-f]{15,17}", fullmatch=True),
    "relays": st.lists(_ADDRESSES, max_size=3),
    "code": st.sampled_from(["MALFORMED", "BUSY", "NOPE"]),
    "relay": _ADDRESSES,
    "relay_root": st.none() | _ADDRESSES,
    "own_address": _ADDRESSES,
    "transfer_id": st.from_regex(r"v[0-9]{1,3}-[0-9a-f]{15,17}", fullmatch=True) | _IDS,
}
_NUMBERS = st.integers(-1, 2**64) | st.floats(-1, 1e6, allow_nan=False) | st.booleans()


def _value(name: str) -> st.SearchStrategy[Any]:
    if name in _PLAUSIBLE:
        return _PLAUSIBLE[name] | _JSON
    if name.endswith("_id"):
        return _IDS | _JSON
    return _NUMBERS | _JSON


@st.composite
def headers(draw: st.DrawFn) -> dict[str, Any]:
    """A header with a plausible protocol and kind and a random subset of (mostly) typed fields."""
    names = draw(st.lists(st.sampled_from([*sorted(FIELDS), "extra"]), max_size=10, unique=True))
    header: dict[str, Any] = {name: draw(_value(name)) for name in names}
    header["protocol"] = draw(st.sampled_from([PROTOCOL, "refit-zmq/0", 1]))
    header["kind"] = draw(st.sampled_from([*(k.value for k in Kind), "BOGUS", None]))
    return header


@st.composite
def structured(draw: st.DrawFn) -> list[bytes]:
    """A JSON header, an empty or random MAC, maybe a chunk, maybe extra frames."""
    header = json.dumps(draw(headers())).encode()
    frames = [header, draw(st.sampled_from([b"", b"\\x00" * 32]) | st.binary(max_size=40))]
    frames += draw(st.lists(st.binary(max_size=64), max_size=2))
    return frames


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    """A valid DATA, BEGIN or FLUSH message with one byte flipped, a frame cut or added."""
    fields: dict[str, Any] = {
        "transfer_id": "v1-00000000000000a1",
        "producer_id": "p",
        "payload_id": "0",
        "checksum": "a" * 32,
        "total_bytes": 8,
        "offset": 0,
    }
    kind = draw(st.sampled_from([Kind.DATA, Kind.BEGIN]))
    if kind is Kind.BEGIN:
        del fields["offset"]
        fields.update(verification_candidates=1, base=None, target=1, deadline_s=5.0)
    frames = [
        bytes(f) for f in encode(kind, fields, _SIGNER, b"12345678" if kind is Kind.DATA else None)
    ]
    at = draw(st.integers(0, len(frames) - 1))
    how = draw(st.sampled_from(["flip", "cut", "add", "truncate"]))
    if how == "flip" and frames[at]:
        target = bytearray(frames[at])
        target[draw(st.integers(0, len(target) - 1))] ^= draw(st.integers(1, 255))
        frames[at] = bytes(target)
    elif how == "cut":
        del frames[at]
    elif how == "add":
        frames.insert(at, draw(st.binary(max_size=16)))
    else:
        frames[at] = frames[at][: draw(st.integers(0, len(frames[at])))]
    return frames


frame_lists = st.lists(st.binary(max_size=48), max_size=5) | structured() | mutated()
"""Any list of frames, weighted towards ones that get deep into the parser."""
