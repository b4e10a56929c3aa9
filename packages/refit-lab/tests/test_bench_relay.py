"""The `relay` bench on a tiny model: registration, sizes, loopback, and the shaped LAN."""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from refit_lab.bench import relay
from refit_lab.bench.harness import BENCHES, BenchContext, load_bench

MiB = 1 << 20
TINY = relay.Sizes(dense_bytes=4 * MiB, tree_bytes=4 * MiB, repeats=1, receivers=(1, 2), hidden=128)

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
    assert summary["transport_efficiency_vs_raw_zmq"] > 0
    assert summary["transport_efficiency_vs_raw_zmq_reference_gbps"] > 0
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
    _check_loopback_ratios(summary, report.results)


LOOPBACK_RATIOS = {
    "transport_efficiency_vs_raw_zmq": ("loopback_dense", "loopback_raw_zmq"),
    "ceiling_vs_raw_zmq": ("loopback_transactional_zmq", "loopback_raw_zmq"),
    "transport_efficiency_vs_ceiling": ("loopback_dense", "loopback_transactional_zmq"),
}


def _check_loopback_ratios(summary: Mapping[str, Any], rows: list[dict[str, Any]]) -> None:
    """Every loopback ratio is the median over rounds of the subject's rate (dense bytes over
    its seconds in that round) over the reference's, recomputed from the rows."""
    by_case = {row["case"]: row for row in rows}
    for key, (subject, reference) in LOOPBACK_RATIOS.items():
        a, b = by_case[subject], by_case[reference]
        per_round = [
            (a["dense_bytes"] / sa) / (b["dense_bytes"] / sb)
            for sa, sb in zip(a["round_s"], b["round_s"], strict=True)
        ]
        assert summary[key] == pytest.approx(statistics.median(per_round), rel=1e-12)
        rate = statistics.median(b["dense_bytes"] / s / 1e9 for s in b["round_s"])
        assert summary[f"{key}_reference_gbps"] == pytest.approx(rate, rel=1e-12)


def test_loopback_ratios_put_the_refit_over_its_references() -> None:
    """A refit twice as slow as the raw stream is at 0.5 of it (not 2)."""
    rows = [
        {"case": "loopback_dense", "dense_bytes": 8, "round_s": [2.0, 4.0, 8.0]},
        {"case": "loopback_raw_zmq", "dense_bytes": 8, "round_s": [1.0, 2.0, 4.0]},
        {"case": "loopback_transactional_zmq", "dense_bytes": 8, "round_s": [1.0, 4.0, 4.0]},
    ]
    ratios = relay.loopback_ratios(rows)
    assert ratios["transport_efficiency_vs_raw_zmq"] == pytest.approx(0.5)
    assert ratios["ceiling_vs_raw_zmq"] == pytest.approx(1.0)
    assert ratios["transport_efficiency_vs_ceiling"] == pytest.approx(0.5)
    _check_loopback_ratios(ratios, rows)


def _leftovers(tag: str) -> str:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    return "\n".join(line for line in (listing.stdout + links.stdout).splitlines() if tag in line)


@pytest.mark.netns
def test_shaped_cases_run_on_namespaces_and_clean_up() -> None:
    rows, summary = relay.shaped(BenchContext(quick=True, threads=1), TINY)
    assert summary["shaped_bitexact"] is True
    assert set(summary) >= {
        "shaped_sparse_speedup_vs_dense",
        "shaped_tree1_vs_star1",
        "shaped_tree_time_ratio_2_vs_1",
        "shaped_star_time_ratio_2_vs_1",
    }
    star = next(r for r in rows if r["case"] == "shaped_star_dense" and r["receivers"] == 2)
    veth = star["veth_bytes_tree_and_star"]
    assert isinstance(veth, list) and veth[0]["sent"] >= 3 * TINY.tree_bytes
    assert summary["shaped_sparse_speedup_vs_dense_reference_gbps"] > 0
    assert _leftovers(relay.ShapedLan(1).bridge[:-2]) == ""
