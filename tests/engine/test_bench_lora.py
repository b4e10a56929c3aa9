"""`refit bench lora` in its smallest form: one round per kind of step on a real engine, both
paths generating alike, each summary ratio what the bench's own rows give."""

from __future__ import annotations

import dataclasses

import pytest

from refit_lab.bench.harness import BENCHES, BenchContext
from refit_lab.bench.lora import KINDS, QUICK, measure
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

SUMMARY_RATIOS = {
    **{
        f"{kind}_refit_vs_disk_load": Ratio(
            Side("refit_s", {"kind": kind}), Side("disk_load_s", {"kind": kind})
        )
        for kind in KINDS
    },
    **{
        f"{kind}_wire_over_adapter_bytes": Ratio(
            Side("wire_bytes", {"kind": kind}), Side("adapter_bytes", {"kind": kind})
        )
        for kind in KINDS
    },
}
"""Each summary ratio: the rows (one per kind and round) it compares, subject first."""


def test_one_round_per_kind_of_step() -> None:
    assert BENCHES["lora"] == "refit_lab.bench.lora:run"
    report = measure(BenchContext(quick=True, threads=1), dataclasses.replace(QUICK, rounds=1))
    assert [r["case"] for r in report.results] == [f"{kind} round 1" for kind in KINDS]
    assert report.summary["bitexact"] is True
    assert report.summary["refit_in_flight_kept_its_version"] is True
    assert report.summary["vllm_in_place_kept_its_version"] is False
    assert report.summary["sparse_wire_over_adapter_bytes"] < 0.2  # the delta pays
    check_summary_ratios(report, SUMMARY_RATIOS, other_keys={"adapter_bytes"})
    report.to_json()
