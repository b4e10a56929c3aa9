"""Fixtures of the relay tests: relays in child processes, seeded states, producers; one relay
in this process and a plain-pyzmq client for the wire-rule tests.

The directory goes on ``sys.path`` so child processes can import :mod:`relay_helpers` by name.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from relay_helpers import (  # noqa: E402
    KEY,
    KEY_VAR,
    RelayFleet,
    RelaySpec,
    Trainer,
    make_state,
)
from wire_helpers import Wire, serving_relay  # noqa: E402

from refit_core import WeightVersion  # noqa: E402
from refit_zmq.codec import DeltaPayload  # noqa: E402
from refit_zmq.relay import ZmqSparseRefitServer  # noqa: E402


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The test API key, in the environment variable producers and relays read."""
    monkeypatch.setenv(KEY_VAR, KEY)
    return KEY


@pytest.fixture(scope="module")
def keyed_relay() -> Iterator[RelayFleet]:
    """One relay requiring the test API key, shared by a module's tests."""
    with RelayFleet([RelaySpec(api_key=KEY)]) as fleet:
        yield fleet


@pytest.fixture
def relay() -> Iterator[tuple[ZmqSparseRefitServer, str]]:
    """One relay in this process, its own whole tree (see :func:`wire_helpers.serving_relay`)."""
    with serving_relay() as served:
        yield served


@pytest.fixture
def wire(relay: tuple[ZmqSparseRefitServer, str]) -> Iterator[Wire]:
    """A plain-pyzmq client of :func:`relay`."""
    created = Wire(relay[1])
    try:
        yield created
    finally:
        created.close()


@pytest.fixture
def delta() -> Iterator[DeltaPayload]:
    """One payload of a 1% delta from version 0 to 1 against ``make_state(91)``."""
    trainer = Trainer(make_state(91), version=0)
    try:
        trainer.step(seed=92)
        yield next(iter(trainer.shards[0].tracker.encode(trainer.state, WeightVersion(1))))
    finally:
        trainer.close()
