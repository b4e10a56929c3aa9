"""SGLang-code engines in processes of their own, and a deployment that reads them over HTTP."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from refit_lab.conformance import RefitDeployment
from refit_lab.faults import ProcessGang
from refit_lab.reference_engine import ReferenceModelConfig
from sglang_code import serve_in_child

START_S = 180.0
"""An engine process imports SGLang (tens of seconds on a loaded machine)."""


def start_engines(
    gang: ProcessGang, config: ReferenceModelConfig, tp_sizes: Sequence[int], seed: int
) -> list[str]:
    """One engine process per entry of ``tp_sizes``; their base URLs, in that order."""
    for index, tp_size in enumerate(tp_sizes):
        gang.spawn(serve_in_child, dataclasses.asdict(config), seed + index, tp_size, gang.results)
    urls: list[str] = gang.collect(len(tp_sizes), timeout_s=START_S)
    ports = {url: int(url.rsplit(":", 1)[1]) for url in urls}
    return sorted(urls, key=lambda url: _tp_size(url) * 100_000 + ports[url])


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
    """A trainer refitting engines in other processes; ``gang`` ends them."""

    urls: Sequence[str] = ()
    gang: ProcessGang = field(default_factory=ProcessGang)

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

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.gang.reap()
