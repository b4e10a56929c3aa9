"""What the dense rows' engine tests (collective, IPC) check, given each row's own refit.

``refit(state, staged)`` runs a complete refit to ``state`` from a trainer in the test's
process and returns its version; the failure checks take the error of a refit to A whose
trainer failed part-way.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_helpers import Engine, Pending, generate

from refit_core import EngineState, RefitError

Refit = Callable[[str, bool], int]
HELD_S = 3.0


def refits_away_and_back(engine: Engine, refit: Refit) -> None:
    """B' -> A (staged) -> B' (streamed): vLLM's own outputs each time, the prefix cache
    dropped by every commit, the version reported to vLLM."""
    llm = engine.llm
    generate(llm, expect_cached=True)  # B' prefixes are cached now
    refit("A", True)
    assert generate(llm, expect_cached=False) == engine.expected["A"], "a fresh engine's on A"
    version = refit("B'", False)
    assert generate(llm, expect_cached=False) == engine.expected["B'"]
    assert llm.llm_engine.get_weight_version() == str(version)


def previous_weights_after(engine: Engine, error: RefitError, served: str, refit: Refit) -> None:
    """A staged refit that failed: the engine serves exactly B' at once (never closed), and
    the next refits work."""
    assert error.states() == {"vllm engine 0": EngineState.OLD}, error
    (report,) = error.engines
    version = int(served) if served.isdigit() else None  # None: the weights it started on
    assert report.version == version, "the report names the version it still serves"
    assert generate(engine.llm) == engine.expected["B'"], "exactly the previous weights, serving"
    assert engine.llm.llm_engine.get_weight_version() == served
    refit("A", True)
    assert generate(engine.llm) == engine.expected["A"]
    refit("B'", True)


def closed_until_a_refit(engine: Engine, error: RefitError, refit: Refit) -> None:
    """A streamed refit that failed after writing the model: the engine is closed (a request
    gets no token) until a complete refit, which answers it on the new weights."""
    assert error.states() == {"vllm engine 0": EngineState.CLOSED}, error
    (report,) = error.engines
    assert report.version is None, "a closed engine serves no version"
    assert not error.is_retryable
    held = Pending(engine.llm)
    assert not held.answered_within(HELD_S), "a closed engine generates nothing"
    refit("B''", False)
    assert held.outputs() == engine.expected["B''"], "the held request ran on the new weights"
    assert generate(engine.llm) == engine.expected["B''"]
    refit("B'", True)
