"""The demo's Dynamo fleet: worker processes each running Dynamo's real system server with the
RL admin routes over a reference engine (:mod:`refit_lab.dynamo_lab`), and their channel.

The demo verifies every worker through the worker's own routes: Dynamo's
``get_weight_version`` for the served version, and the lab routes ``_test/digests`` and
``_test/generate`` for every engine rank's bits and greedy tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from refit_dynamo import AdminClient, DynamoRefitChannel
from refit_lab.dynamo_lab.fleet import Worker

__all__ = ["DynamoDemoFleet"]

logger = logging.getLogger(__name__)


def _agreed(ranks: list[Any]) -> Any:
    """What every engine rank reports, or None where ranks disagree (verification fails)."""
    return ranks[0] if all(r == ranks[0] for r in ranks) else None


class DynamoDemoFleet:
    """The Dynamo workers as the demo verifies them; ``channel`` is the factory's generation.

    The fleet is fixed: a Dynamo worker's communicator cannot be aborted from outside, so no
    worker is ever dropped.
    """

    exposes_bits = True
    """Each engine rank reports checkpoint-format digests of the weights it serves."""

    def __init__(self, workers: list[Worker], control_timeout_s: float) -> None:
        self._workers = workers
        self._admin = AdminClient(control_timeout_s)
        self.channel = DynamoRefitChannel(
            [w.endpoint for w in workers],
            engine_world_size=1,
            control_timeout_s=control_timeout_s,
            device="cpu",  # reference engines receive over gloo
        )

    @property
    def live(self) -> list[int]:
        """Every worker (the fleet never shrinks)."""
        return list(range(len(self._workers)))

    def call(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` on every worker; index -> result."""
        methods: dict[str, Callable[..., Any]] = {
            "state_digests": self._state_digests,
            "served_version": self._served_version,
            "generate": self._generate,
        }
        return {i: methods[method](worker, *args) for i, worker in enumerate(self._workers)}

    def _state_digests(self, worker: Worker) -> Any:
        return _agreed(worker.call("digests")["ranks"])

    def _served_version(self, worker: Worker) -> Any:
        return self._admin.post(worker.endpoint, "get_weight_version", {})["version"]

    def _generate(self, worker: Worker, prompts: list[list[int]], new_tokens: int) -> Any:
        body = {"prompts": prompts, "max_new_tokens": new_tokens}
        return _agreed(worker.call("generate", body)["ranks"])

    def close(self) -> None:
        """Close the admin connections (the processes belong to their starter)."""
        self._admin.close()
        self.channel.close()
