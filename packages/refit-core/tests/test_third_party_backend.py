"""A backend package outside refit, installed into a fresh venv beside refit-core alone, is
listed by ``refit backends`` and built by ``create_weight_synchronizer``, with no change to
refit-core (``toy_backend/`` is copied to a temporary directory and never published)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CORE = Path(__file__).parents[1]
TOY = Path(__file__).parent / "toy_backend"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("uv") is None, reason="uv builds the fresh venv"),
]

USE = textwrap.dedent(
    """
    import json, sys
    from refit_core.cli import main

    main(["backends", "--json"])  # lists every row: the toy's package and rows module only
    listed = sorted(m for m in sys.modules if m.split(".")[0] == "refit_toy")

    from refit_core import RefitError, create_weight_synchronizer
    from refit_toy import ToyEngine, ToyOptions, ToyPolicy

    class MeetingPoint:
        def get_master_address_and_port(self):
            return "10.1.2.3", 29511

    weights = {"embed": bytes(range(10)), "head": b"xyz"}
    near, far = ToyEngine(), ToyEngine()
    colocated = create_weight_synchronizer(
        ToyPolicy(weights), near, "toy", True, options=ToyOptions(chunk_bytes=3)
    )
    remote = create_weight_synchronizer(
        ToyPolicy(weights), far, "toy", False, train_cluster=MeetingPoint(), refit_timeout_s=5.0
    )
    versions = [colocated.sync_weights().version, remote.sync_weights().version]
    far.broken = True
    try:
        remote.sync_weights()
    except RefitError as error:
        failed = [str(error), [(e.worker, e.state.value, e.version) for e in error.engines]]
    status = remote.status()
    try:
        ToyOptions(chunk_bytes="3")
    except TypeError as error:
        refused = str(error)
    print(json.dumps({
        "listed": listed,
        "types": [type(colocated).__name__, type(remote).__name__],
        "versions": versions,
        "delivered": [near.weights == weights, far.weights == weights],
        "meeting_point": list(remote.meeting_point),
        "failed": failed,
        "status": status.describe(),
        "recovered": remote.recover().after.agreed_version,
        "refused": refused,
    }))
    """
)


def run(*args: str | Path) -> str:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(300)
def test_a_package_outside_refit_is_listed_and_built(tmp_path: Path) -> None:
    package = tmp_path / "refit-toy"
    shutil.copytree(TOY, package)
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    run("uv", "venv", "--quiet", "--python", sys.executable, venv)
    run("uv", "pip", "install", "--quiet", "--python", python, CORE, package)

    listed = json.loads(run("uv", "pip", "list", "--format", "json", "--python", python))
    assert {p["name"] for p in listed} == {"refit-core", "refit-toy"}

    records = {r["key"]: r for r in json.loads(run(venv / "bin" / "refit", "backends", "--json"))}
    wire = records["toy.non-colocated.wire"]
    assert (wire["status"], wire["package"], wire["version"]) == ("installed", "refit-toy", "0.3.0")
    assert (wire["default"], wire["can_stage"], wire["clusters"]) == (
        True,
        False,
        ["train_cluster"],
    )
    assert records["vllm.non-colocated.collective"]["status"] == "missing"
    assert records["vllm.non-colocated.collective"]["install_hint"] == (
        'pip install "refit-core[vllm]"'
    )

    used = json.loads(run(python, "-c", USE).splitlines()[-1])
    assert used["listed"] == ["refit_toy", "refit_toy.rows"], "a heavy __init__ slows listing"
    assert {k: used[k] for k in ("types", "versions", "delivered", "meeting_point")} == {
        "types": ["ToySynchronizer", "ToySynchronizer"],
        "versions": [1, 1],
        "delivered": [True, True],
        "meeting_point": ["10.1.2.3", 29511],
    }
    message, engines = used["failed"]
    assert message.startswith("toy engine: load: the engine refuses new weights")
    assert message.count("toy engine") == 2  # its label, then what it serves: "... as before"
    assert engines == [["toy engine", "old", 1]]
    assert (used["status"], used["recovered"]) == ("version 1 on shards [0]", 1)
    assert used["refused"] == "ToyOptions.chunk_bytes takes int, got '3' (str)"
