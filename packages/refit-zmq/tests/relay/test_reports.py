"""The protocol's reports: JSON round trips, and a reader that refuses anything else."""

from __future__ import annotations

from typing import Any

import pytest

from refit_core import ProtocolError
from refit_zmq.relay import (
    AbortReply,
    ApplyResult,
    ChildCounts,
    CommitReply,
    Failure,
    FlushReport,
    LedgerOpen,
    OutcomeReply,
    ReceiverOpen,
    RelayStatus,
    SubtreeReport,
    TransferState,
    TreeReply,
)

T = "v2-00000000000000aa"
FAILURE = Failure("tcp://a:1", "UNREACHABLE", "no answer")
REPORT = FlushReport(
    relay="tcp://a:1",
    transfer_id=T,
    state=TransferState.OPEN,
    complete=False,
    expected=3,
    applied=2,
    duplicates=0,
    bytes_received=10,
    bytes_forwarded=20,
    apply_s=0.5,
    elapsed_s=1.5,
    version=1,
    children={"tcp://b:2": ChildCounts(2, 1, 1)},
    failures=(FAILURE, Failure("tcp://b:2", "CHECKSUM", "bad", "shard-0", "0.1")),
    digests={"w": (1 << 64) - 1},
)
REPORTS: list[Any] = [
    FAILURE,
    ApplyResult(3, 100, 8),
    REPORT,
    SubtreeReport({"tcp://a:1": REPORT}),
    CommitReply(T, 2, committed=True),
    AbortReply(T, 1, aborted=True, restored=False),
    RelayStatus(
        "tcp://a:1",
        1,
        ReceiverOpen(T, 2, 3, 400),
        LedgerOpen(T, 2, TransferState.PREPARED, 0.0, 3, 0),
        "0123456789abcdef",
        0,
        1 << 20,
    ),
    OutcomeReply(T, TransferState.COMMITTED),
    TreeReply("0123456789abcdef"),
]


@pytest.mark.parametrize("report", REPORTS, ids=lambda r: type(r).__name__)
def test_every_report_round_trips_through_json(report: Any) -> None:
    assert type(report).from_json(report.to_json()) == report


def test_a_failure_without_payload_ids_leaves_them_out() -> None:
    assert FAILURE.to_json() == {
        "relay": "tcp://a:1",
        "code": "UNREACHABLE",
        "message": "no answer",
    }


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"surprise": 1}, "unknown fields"),
        ({"applied": None}, "'applied'"),
        ({"elapsed_s": None}, "'elapsed_s'"),
        ({"elapsed_s": -1.0}, "'elapsed_s'"),
        ({"state": "half"}, "'state'"),
        ({"complete": True}, "complete"),
        ({"failures": [{"relay": "r", "code": "NOPE", "message": ""}]}, "failure code"),
        ({"digests": {"w": 1 << 64}}, "digest"),
    ],
)
def test_a_flush_report_that_breaks_its_table_is_refused(
    change: dict[str, Any], error: str
) -> None:
    with pytest.raises(ProtocolError, match=error):
        FlushReport.from_json({**REPORT.to_json(), **change})


def test_a_missing_field_is_refused() -> None:
    data = CommitReply(T, 2, committed=True).to_json()
    del data["committed"]
    with pytest.raises(ProtocolError, match="lacks 'committed'"):
        CommitReply.from_json(data)
