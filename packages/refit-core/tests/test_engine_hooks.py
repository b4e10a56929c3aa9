"""Engine notifications: optional methods, called when present, refused when misspelled."""

from __future__ import annotations

import pytest

from refit_core.engine_hooks import notify


class _Listening:
    def __init__(self) -> None:
        self.heard: list[tuple[str, int, dict[str, bool]]] = []

    def on_refit_begin(self, version: int) -> None:
        self.heard.append(("begin", version, {}))

    def on_refit_abort(self, version: int, *, weights_changed: bool) -> None:
        self.heard.append(("abort", version, {"weights_changed": weights_changed}))


def test_present_hooks_are_called_and_missing_ones_skipped() -> None:
    engine = _Listening()
    assert notify(engine, "on_refit_begin", 3)
    assert notify(engine, "on_refit_abort", 3, weights_changed=True)
    assert not notify(engine, "on_refit_commit", 3)
    assert engine.heard == [("begin", 3, {}), ("abort", 3, {"weights_changed": True})]
    assert not notify(object(), "on_refit_begin", 1)


def test_an_unknown_hook_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown refit hook"):
        notify(_Listening(), "on_refit_started", 1)


def test_a_failing_hook_propagates() -> None:
    class Broken:
        def on_refit_begin(self, version: int) -> None:
            raise RuntimeError("cannot pause")

    with pytest.raises(RuntimeError, match="cannot pause"):
        notify(Broken(), "on_refit_begin", 1)
