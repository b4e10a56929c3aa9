"""Shared fixtures of refit-nccl's tests.

The tests directory goes on ``sys.path`` so spawned worker processes can import
:mod:`nccl_workers` by name (the spawn start method sends the parent's ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="session")
def gloo_reports() -> list[dict[str, Any]]:
    """Every report of the shared gloo worker processes (collective steps, then faults)."""
    from nccl_workers import launch_session
    from refit_lab.faults import ProcessGang

    with ProcessGang() as gang:
        expected = launch_session(gang)
        reports: list[dict[str, Any]] = gang.collect(expected, timeout_s=240)
    return reports
