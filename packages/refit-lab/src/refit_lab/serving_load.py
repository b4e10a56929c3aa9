"""Requests that keep a fleet of reference engines (Ray actors) decoding without a break, and
the check that each came back whole.

Client threads, :data:`CLIENTS_PER_ENGINE` per engine, each submit a request of random prompts,
wait for its output (a :class:`~refit_lab.reference_engine.GenerationOutput`), check it is
complete and submit the next. What refits do under them shows in the counts: a request that
fails or comes back short is lost.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refit_lab.reference_engine import GenerationOutput

__all__ = [
    "CLIENTS_PER_ENGINE",
    "NEW_TOKENS",
    "REQUEST_WAIT_S",
    "ServingCounts",
    "ServingLoad",
    "complete",
]

logger = logging.getLogger(__name__)

CLIENTS_PER_ENGINE = 2
PROMPT_TOKENS = 4
PROMPTS_PER_REQUEST = 2
NEW_TOKENS = 12
REQUEST_WAIT_S = 120.0
"""How long a request that arrives during a pause waits for the engine (never reached)."""
CALL_TIMEOUT_S = 120.0
"""How much longer than :data:`REQUEST_WAIT_S` a client waits for its answer."""


def complete(output: GenerationOutput, new_tokens: int) -> bool:
    """Every prompt got all ``new_tokens`` tokens and version spans covering them in order."""
    for tokens, spans in zip(output.tokens, output.weight_versions, strict=True):
        ends = [0, *(span.end for span in spans)]
        if len(tokens) != new_tokens or [s.start for s in spans] != ends[:-1]:
            return False
        if ends[-1] != new_tokens:
            return False
    return True


@dataclass
class ServingCounts:
    """Requests submitted, those that came back complete, and the errors of the others."""

    submitted: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Requests that failed or came back incomplete."""
        return self.submitted - self.completed


class ServingLoad:
    """Client threads that keep every worker decoding (see the module docstring).

    Args:
        workers: Ray actor handles whose ``method(prompts, max_new_tokens, wait_s)`` returns
            a ``GenerationOutput``.
        vocab_size: prompts are drawn from ``range(vocab_size)``.
        seed: seeds every client's prompts.
        method: the workers' generation method.
    """

    def __init__(
        self, workers: Sequence[Any], vocab_size: int, *, seed: int, method: str = "generate"
    ) -> None:
        self._vocab_size = vocab_size
        self._seed = seed
        self._method = method
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.counts = ServingCounts()
        self._threads = [
            threading.Thread(target=self._serve, args=(worker, client), name=f"client-{client}")
            for client, worker in enumerate(w for w in workers for _ in range(CLIENTS_PER_ENGINE))
        ]

    def start(self) -> None:
        """Start every client thread."""
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = CALL_TIMEOUT_S + REQUEST_WAIT_S) -> None:
        """Let each client finish its request in flight, then return (within ``timeout_s``).

        Raises:
            TimeoutError: a client still waits for its answer.
        """
        self._stop.set()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"clients still waiting after {timeout_s:.0f} s: {alive}")

    def _serve(self, worker: Any, client: int) -> None:
        import ray

        rng = random.Random(self._seed * 1000 + client)
        while not self._stop.is_set():
            prompts = [
                [rng.randrange(self._vocab_size) for _ in range(PROMPT_TOKENS)]
                for _ in range(PROMPTS_PER_REQUEST)
            ]
            with self._lock:
                self.counts.submitted += 1
            try:
                call = getattr(worker, self._method).remote(prompts, NEW_TOKENS, REQUEST_WAIT_S)
                output: GenerationOutput = ray.get(call, timeout=REQUEST_WAIT_S + CALL_TIMEOUT_S)
            except Exception as exc:  # a lost request: counted, and this client stops
                logger.error("request failed: %s", exc)
                with self._lock:
                    self.counts.errors.append(repr(exc))
                return
            with self._lock:
                self.counts.completed += complete(output, NEW_TOKENS)
