"""The rows' options are checked where they are built: a field of the wrong type fails there,
not at the first refit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refit_zmq.ipc import IpcOptions
from refit_zmq.sparse import ZmqSparseOptions, attempt_timeout_s


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda: ZmqSparseOptions(shard_count=2.0), r"ZmqSparseOptions.shard_count takes int"),
        (lambda: ZmqSparseOptions(tuning={}), r"ZmqSparseOptions.tuning takes RelayTuning"),
        (lambda: ZmqSparseOptions(call_timeout_s=True), r"call_timeout_s takes float, got True"),
        (lambda: IpcOptions(buffer_size_bytes="1"), r"IpcOptions.buffer_size_bytes takes int"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_when_built(build: object, says: str) -> None:
    with pytest.raises(TypeError, match=says):
        build()  # type: ignore[operator]
    assert ZmqSparseOptions(call_timeout_s=5).call_timeout_s == 5


def test_the_readme_states_the_status_probe_the_defaults_give() -> None:
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    stated = re.search(
        r"defaults (\d+) s and (\d+) retries, so ([\d.]+) s per attempt with a (\d+) s deadline",
        readme,
    )
    assert stated is not None, "the README no longer states the probe's defaults"
    call_s, retries, attempt_s, deadline_s = stated.groups()
    options = ZmqSparseOptions()
    assert (float(call_s), int(retries)) == (options.call_timeout_s, options.tuning.retries)
    assert attempt_timeout_s(options, float(deadline_s)) == float(attempt_s)
