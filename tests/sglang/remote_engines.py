"""SGLang-code engines in processes of their own, and a deployment that reads them over HTTP."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from sglang_code import serve_in_child

from refit_lab.conformance import RefitDeployment
from refit_lab.reference_engine import ReferenceModelConfig

START_S = 600.0
"""Every engine and rank process imports torch and SGLang (about 40 s each here when the
machine is idle; minutes when several start at once on a loaded machine)."""


@contextmanager
def engine_processes(
    config: ReferenceModelConfig, tp_sizes: Sequence[int], seed: int
) -> Iterator[list[str]]:
    """One engine process per entry of ``tp_sizes`` (each starts a process per rank, so they
    are not daemons); yields their base URLs in that order and kills them at the end (their
    ranks exit when the engine's pipes close)."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[str] = context.Queue()
    processes = [
        context.Process(
            target=serve_in_child,
            args=(dataclasses.asdict(config), seed + index, tp_size, results),
            daemon=False,
        )
        for index, tp_size in enumerate(tp_sizes)
    ]
    try:
        for process in processes:
            process.start()
        end = time.monotonic() + START_S
        urls = [results.get(timeout=max(0.0, end - time.monotonic())) for _ in processes]
        yield sorted(urls, key=lambda url: (_tp_size(url), url))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=30)


def _tp_size(url: str) -> int:
    return int(httpx.get(f"{url}/get_server_info", timeout=30).json()["tp_size"])


def inspect(url: str, what: str = "state", **body: Any) -> dict[str, Any]:
    """An engine's state (or greedy tokens, ``what="generate"``) from its process."""
    reply = httpx.post(f"{url}/_test/{what}", json=body, timeout=60)
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()
    return result


@dataclass
class RemoteDeployment(RefitDeployment):
    """A trainer refitting engines in other processes (which outlive it)."""

    urls: Sequence[str] = ()

    def engine_digests(self) -> list[dict[str, int]]:
        return [d for url in self.urls for d in inspect(url)["digests"]]

    def engine_versions(self) -> list[int]:
        return [v for url in self.urls for v in inspect(url)["versions"]]

    def engine_generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[list[int]]]:
        return [
            tokens
            for url in self.urls
            for tokens in inspect(
                url, "generate", prompts=[list(p) for p in prompts], max_new_tokens=max_new_tokens
            )["tokens"]
        ]
