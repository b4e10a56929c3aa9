"""The one-shot watchdog."""

from __future__ import annotations

import threading

import pytest

from refit_core.backend import Deadline
from refit_nccl.group.watchdog import Watchdog


@pytest.mark.timeout(10)
def test_fires_once_when_the_deadline_passes_inside() -> None:
    fired = threading.Event()
    with Watchdog(Deadline.after(0.05), fired.set, what="test") as dog:
        assert fired.wait(5)
    assert dog.fired


@pytest.mark.timeout(10)
def test_leaving_before_the_deadline_disarms_it() -> None:
    fired = threading.Event()
    with Watchdog(Deadline.after(0.2), fired.set, what="test") as dog:
        pass
    assert not fired.wait(0.5)
    assert not dog.fired


def test_disarmed_deadline_starts_no_thread() -> None:
    before = threading.active_count()
    with Watchdog(Deadline.never(), lambda: None, what="test"):
        assert threading.active_count() == before


@pytest.mark.timeout(10)
def test_a_failing_callback_does_not_escape() -> None:
    done = threading.Event()

    def explode() -> None:
        done.set()
        raise RuntimeError("abort failed")

    with Watchdog(Deadline.after(0.01), explode, what="test") as dog:
        assert done.wait(5)
    assert dog.fired
