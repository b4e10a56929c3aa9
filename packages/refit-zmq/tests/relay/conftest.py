"""Fixtures of the relay tests: relays in child processes, seeded states, producers.

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

from relay_helpers import KEY, KEY_VAR, RelayFleet, RelaySpec  # noqa: E402


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
