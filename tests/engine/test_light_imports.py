"""Importing refit's transport packages, their vLLM integration included (refit-core's vLLM
worker modules too), never imports vLLM (only vLLM's workers load the receivers, and a load
imports vLLM's reload). Run where vLLM is installed, so it can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_refit_vllm_modules_do_not_import_vllm() -> None:
    script = (
        "import json, sys\n"
        "import refit_nccl, refit_nccl.vllm, refit_nccl.vllm_native, refit_zmq, refit_zmq.vllm\n"
        "import refit_zmq.sparse, refit_dynamo\n"
        "import refit_core.vllm.loading, refit_core.vllm.runtime_check, refit_core.vllm.write_map\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
