"""The `relay` bench on a tiny model: registration, sizes, loopback, and the shaped LAN."""

from __future__ import annotations

import subprocess

import pytest
import torch

from refit_lab.bench import relay
from refit_lab.bench.harness import BENCHES, BenchContext, BenchReport, load_bench
from refit_lab.bench.ratio_check import Ratio, Side, check_summary_ratios

MiB = 1 << 20
TINY = relay.Sizes(dense_bytes=4 * MiB, tree_bytes=4 * MiB, repeats=2, receivers=(1, 2), hidden=128)


def _dense(case: str, **where: object) -> Side:
    return Side("gbps_dense", {"case": case, **where})


def _seconds(case: str, receivers: int) -> Side:
    return Side("seconds", {"case": case, "receivers": receivers})


LOOPBACK_RATIOS = {
    "transport_efficiency_vs_raw_zmq": Ratio(_dense("loopback_dense"), _dense("loopback_raw_zmq")),
    "ceiling_vs_raw_zmq": Ratio(_dense("loopback_transactional_zmq"), _dense("loopback_raw_zmq")),
    "transport_efficiency_vs_ceiling": Ratio(
        _dense("loopback_dense"), _dense("loopback_transactional_zmq")
    ),
}
SHAPED_RATIOS = {
    "shaped_sparse_speedup_vs_dense": Ratio(
        _dense("shaped_sparse_1pct"), _dense("shaped_raw_dense")
    ),
    "shaped_tree1_vs_star1": Ratio(
        _dense("shaped_tree_dense", receivers=1),
        _dense("shaped_star_dense", receivers=1),
        time=True,
    ),
    "shaped_tree_time_ratio_2_vs_1": Ratio(
        _seconds("shaped_tree_dense", 2), _seconds("shaped_tree_dense", 1)
    ),
    "shaped_star_time_ratio_2_vs_1": Ratio(
        _seconds("shaped_star_dense", 2), _seconds("shaped_star_dense", 1)
    ),
}
"""Each summary ratio: the rows it compares, subject first."""

pytestmark = pytest.mark.timeout(300)


def test_relay_is_registered() -> None:
    assert BENCHES["relay"] == "refit_lab.bench.relay:run"
    assert load_bench("relay") is relay.run


def test_models_have_the_promised_sizes() -> None:
    quick = relay.state_bytes(relay.engine_config(relay.QUICK.dense_bytes))
    full = relay.state_bytes(relay.engine_config(relay.FULL.dense_bytes))
    assert 64 * MiB <= quick <= 66 * MiB
    assert 1024 * MiB <= full <= 1060 * MiB


def test_step_changes_about_one_percent() -> None:
    before, after = relay.states(relay.engine_config(TINY.dense_bytes, TINY.hidden), seed=1)
    changed = sum(
        int((before[n].view(torch.int16) != after[n].view(torch.int16)).sum()) for n in before
    )
    total = sum(t.numel() for t in before.values())
    assert 0.005 < changed / total < 0.02


def test_loopback_commits_bitexact_and_reports_the_ratio() -> None:
    report = relay.measure(BenchContext(quick=True, threads=1), TINY, shaped_links=False)
    summary = report.summary
    assert summary["all_receivers_bitexact"] is True and summary["shaped_measured"] is False
    check_summary_ratios(
        report,
        LOOPBACK_RATIOS,
        other_keys={"transport_efficiency_cpu_bound", "loopback_sparse_1pct_gbps_dense"},
    )
    assert 0 < float(summary["transport_efficiency_cpu_bound"]) <= 1
    cases = [r["case"] for r in report.results]
    assert cases == [
        "loopback_dense",
        "loopback_sparse_1pct",
        "loopback_raw_zmq",
        "loopback_transactional_zmq",
        "loopback_receiver_extra",
    ]
    raw, _, extra = report.results[2:]
    assert float(str(raw["cpu_s"])) > 0 and float(str(extra["cpu_s"])) > 0
    sparse = report.results[1]
    assert int(str(sparse["wire_bytes"])) < int(str(sparse["dense_bytes"])) / 10


def _leftovers(tag: str) -> str:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    return "\n".join(line for line in (listing.stdout + links.stdout).splitlines() if tag in line)


@pytest.mark.netns
def test_shaped_cases_run_on_namespaces_and_clean_up() -> None:
    rows, summary = relay.shaped(BenchContext(quick=True, threads=1), TINY)
    assert summary["shaped_bitexact"] is True
    report = BenchReport(bench="relay", quick=True, machine={}, results=rows, summary=summary)
    check_summary_ratios(report, SHAPED_RATIOS)
    star = next(r for r in rows if r["case"] == "shaped_star_dense" and r["receivers"] == 2)
    veth = star["veth_bytes_tree_and_star"]
    assert isinstance(veth, list) and veth[0]["sent"] >= 3 * TINY.tree_bytes
    assert _leftovers(relay.ShapedLan(1).bridge[:-2]) == ""
