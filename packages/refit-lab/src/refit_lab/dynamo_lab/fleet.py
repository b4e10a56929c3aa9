"""Start and stop Dynamo worker processes (:mod:`refit_lab.dynamo_lab.worker`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from refit_dynamo import DynamoWorkerEndpoint
from refit_lab.reference_engine import ReferenceModelConfig

__all__ = ["DEFAULT_MODEL", "Worker", "bare_worker", "dynamo_fleet"]

WORKER_MODULE = "refit_lab.dynamo_lab.worker"
BARE_MODULE = "refit_lab.dynamo_lab.bare_worker"
START_S = 60.0
"""Deadline of a worker's start (imports torch and the Dynamo runtime on a loaded machine)."""
CALL_S = 30.0
"""Timeout of test-only calls."""
DEFAULT_MODEL = ReferenceModelConfig()
"""The workers' model unless told otherwise."""

_ENV = {
    "DYN_SYSTEM_PORT": "0",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_LOG": "warn",
    "DYN_SDK_DISABLE_ANSI_LOGGING": "1",
    "OMP_NUM_THREADS": "1",
}


@dataclass
class Worker:
    """A running worker process and its endpoint."""

    process: subprocess.Popen[str]
    endpoint: DynamoWorkerEndpoint
    log: Path

    def call(self, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST a test-only route (``/engine/_test/{route}``); its JSON answer."""
        answer = httpx.post(
            self.endpoint.route_url(f"_test/{route}"), json=body or {}, timeout=CALL_S
        )
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    def state(self) -> dict[str, Any]:
        """Digests, update counts, pause state and the engine's call log."""
        return self.call("state")

    def set_faults(self, **faults: dict[str, Any]) -> None:
        """Replace the injected faults (method -> ``{"delay_s": s, "fail": message}``) and
        clear the call log."""
        self.call("faults", {"faults": faults})

    def configure(self, engine_world_size: int) -> None:
        """Start the engine over with ``engine_world_size`` fresh ranks."""
        self.call("configure", {"engine_world_size": engine_world_size})


def _read_line(stream: IO[str], timeout_s: float) -> str:
    """The first line of ``stream``, or TimeoutError after ``timeout_s``."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines:
        raise TimeoutError(f"no line within {timeout_s} s")
    return lines[0]


def _spawn(args: list[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[str]:
    with log.open("w") as sink:
        return subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            env={**os.environ, **_ENV, **env},
        )


def _ready(index: int, process: subprocess.Popen[str], log: Path) -> Worker:
    """Wait for the worker's ready line."""
    assert process.stdout is not None
    try:
        ready = json.loads(_read_line(process.stdout, START_S))
    except (TimeoutError, ValueError) as exc:
        raise RuntimeError(f"worker {index} did not start: {log.read_text()[-3000:]}") from exc
    return Worker(process, DynamoWorkerEndpoint(f"worker-{index}", ready["system_url"]), log)


@contextmanager
def _processes(
    commands: list[list[str]], log_dir: Path, env: Mapping[str, str] | None = None
) -> Iterator[Callable[[], list[Worker]]]:
    """Spawn one process per command; yields a call that waits until they all serve.

    Spawning returns at once, so other setup (Ray) can overlap the workers' start. Every
    process is killed on exit.
    """
    processes: list[subprocess.Popen[str]] = []
    logs = [log_dir / f"dynamo-worker-{i}.log" for i in range(len(commands))]
    try:
        processes = [
            _spawn(command, log, env or {}) for command, log in zip(commands, logs, strict=True)
        ]
        yield functools.cache(
            lambda: [
                _ready(i, p, log) for i, (p, log) in enumerate(zip(processes, logs, strict=True))
            ]
        )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=CALL_S)


def dynamo_fleet(
    size: int,
    seed: int,
    log_dir: Path,
    config: ReferenceModelConfig = DEFAULT_MODEL,
    env: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[Callable[[], list[Worker]]]:
    """``size`` reference-engine workers of ``config``, all starting from
    ``random_checkpoint(config, seed)``; ``env`` is added to their environment (for example
    ``REFIT_LAB_RECEIVER=vllm-nccl`` and ``CUDA_VISIBLE_DEVICES``)."""
    command = ["-m", WORKER_MODULE, str(seed), json.dumps(dataclasses.asdict(config))]
    return _processes([command] * size, log_dir, env)


def bare_worker(log_dir: Path) -> contextlib.AbstractContextManager[Callable[[], list[Worker]]]:
    """One worker with no routes behind its system server."""
    return _processes([["-m", BARE_MODULE]], log_dir)
