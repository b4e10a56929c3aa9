"""``import refit_core``, the factory's error paths and ``refit backends`` (which reads every
installed row) load nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "zmq", "ray", "numpy", "httpx", "aiohttp", "requests", "xxhash", "zstandard")


def test_import_and_factory_errors_load_nothing_heavy() -> None:
    script = textwrap.dedent(
        f"""
        import json, sys
        import refit_core
        from refit_core import create_weight_synchronizer
        from refit_core.cli import build_parser
        outcomes = []
        calls = [
            dict(generation_backend="nope", colocated=True),
            dict(generation_backend="vllm", colocated=True, transport="bogus"),
            dict(generation_backend="dynamo", colocated=True),
            dict(generation_backend="vllm", colocated=False),
            dict(generation_backend="vllm", colocated=True, refit_buffer_size_gb=0),
            dict(generation_backend="vllm", colocated=True, refit_timeout_s=-1),
            dict(generation_backend="megatron", colocated=False, refit_timeout_s=0),
        ]
        for kwargs in calls:
            try:
                create_weight_synchronizer(None, None, **kwargs)
            except (ValueError, NotImplementedError, ImportError) as exc:
                outcomes.append(type(exc).__name__)
        build_parser()
        from refit_core.cli import main
        main(["backends", "--json"])  # reads every installed row
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        from importlib.util import find_spec
        nccl = find_spec("refit_nccl") is not None
        print(json.dumps({{"outcomes": outcomes, "heavy": heavy, "nccl": nccl}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    # Without refit-nccl, the collective row is missing: its error names the install line.
    missing = "BackendNotInstalledError"
    assert report["outcomes"] == [
        "ValueError",
        "ValueError",
        "NotImplementedError",
        "ValueError" if report["nccl"] else missing,
        "ValueError",
        "InvalidTimeoutError",
        "InvalidTimeoutError",
    ]


def test_listing_backends_imports_each_backend_package_and_its_rows_module_only() -> None:
    """Reading a row imports its module and, first, its package's ``__init__``: for refit's
    backends nothing else (a heavy ``__init__`` would slow every listing and factory call)."""
    script = textwrap.dedent(
        """
        import json, sys
        from refit_core.registry import discover
        found = discover()
        loaded = sorted(m for m in sys.modules if m.startswith("refit_") and m != "refit_core"
                        and not m.startswith("refit_core."))
        print(json.dumps({"loaded": loaded, "rows": [r.row.key for r in found.rows]}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if not report["rows"]:
        pytest.skip("no backend installed (refit-core's isolated run)")
    for module in report["loaded"]:
        assert module.partition(".")[2] in ("", "rows"), f"listing backends imported {module}"
