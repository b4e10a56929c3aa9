"""ZmqSparseOptions: the STATUS probe's timeout derived from the deadline, or refused where it
does not fit."""

from __future__ import annotations

import pytest

from refit_core.backend import LocalParticipant
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer


@pytest.mark.parametrize(
    ("deadline_s", "probe_s"), [(None, 2.0), (2.0, 1.0), (15.0, 1.5), (60.0, 2.0)]
)
def test_the_probe_is_a_tenth_of_the_deadline_within_bounds(
    deadline_s: float | None, probe_s: float
) -> None:
    assert ZmqSparseOptions().probe_s(deadline_s) == probe_s


def test_a_probe_that_does_not_fit_the_deadline_is_refused_when_built() -> None:
    options = ZmqSparseOptions(probe_timeout_s=3.0)
    assert options.probe_s(12.0) == 3.0
    with pytest.raises(ValueError, match="probe_timeout_s=3.0 does not fit"):
        ZmqSparseWeightSynchronizer(
            [LocalParticipant(object(), "producer 0")],
            lambda: ["tcp://127.0.0.1:1"],
            refit_timeout_s=10.0,
            options=options,
        )
    with pytest.raises(ValueError, match="> 0"):
        ZmqSparseOptions(probe_timeout_s=0)
