"""The README's "Relays, server side" section, run as written; and a tree of separate relay
processes started with ``python -m refit_zmq.relay serve`` and read with ``refit relay
status``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relay_helpers import TUNING, Trainer, digests, make_state

from refit_core.backend import Deadline
from refit_zmq.relay import RelayCoordinator, RelayStatus

pytestmark = pytest.mark.timeout(180)

README = Path(__file__).resolve().parents[2] / "README.md"
SHAPES = (
    "embed.weight=512x256:bfloat16,layers.0.qkv.weight=768x256:bfloat16,"
    "layers.0.mlp.weight=1024x256:bfloat16,layers.0.norm.weight=256:float32,"
    "lm_head.weight=512x256:bfloat16"
)
"""The shapes of ``relay_helpers.SHAPES``, as the launcher takes them."""


def _section() -> str:
    text = README.read_text()
    return text.split("### Relays, server side", 1)[1].split("\n## ", 1)[0]


def test_the_server_side_example_runs_as_written() -> None:
    (block,) = re.findall(r"```python\n(.*?)```", _section(), re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(compile(block, str(README), "exec"), namespace)
    assert namespace["result"].outcome.committed


@pytest.fixture
def processes() -> Iterator[list[tuple[subprocess.Popen[str], str]]]:
    started: list[tuple[subprocess.Popen[str], str]] = []
    try:
        for seed in range(2):
            command = [sys.executable, "-m", "refit_zmq.relay", "serve", "--shapes", SHAPES]
            options = ["--seed", str(seed), "--timeout-s", "10", "--chunk-bytes", "65536"]
            process = subprocess.Popen(
                [*command, *options],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert process.stdout is not None
            line = process.stdout.readline()  # once it listens
            announced = json.loads(line)
            assert (announced["pid"], announced["version"]) == (process.pid, 0)
            started.append((process, announced["address"]))
        yield started
    finally:
        for process, _ in started:
            process.send_signal(signal.SIGTERM)
        for process, _ in started:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def test_a_tree_of_relay_processes_stands_up_and_commits(
    processes: list[tuple[subprocess.Popen[str], str]],
) -> None:
    addresses = [address for _, address in processes]
    refit = Path(sys.executable).with_name("refit")
    shown = subprocess.run(
        [str(refit), "relay", "status", *addresses],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    statuses = json.loads(shown.stdout)
    assert {s["version"] for s in statuses.values()} == {0}
    assert all(s["tree"] is None for s in statuses.values()), "read without a CONFIGURE"

    coordinator = RelayCoordinator(api_key=None, timeout_s=10.0, tuning=TUNING)
    trainer = Trainer(make_state(3), version=0)
    try:
        coordinator.configure_tree(addresses, deadline=Deadline.never())
        trainer.transfer(coordinator, resync=True)
        held = coordinator.status(digests=True, deadline=Deadline.never())
        assert all(
            isinstance(s, RelayStatus) and s.digests == digests(trainer.state) and s.version == 1
            for s in held.values()
        )
    finally:
        trainer.close()
        coordinator.close()
    for process, _ in processes:
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0, "a relay process ends cleanly on SIGTERM"
