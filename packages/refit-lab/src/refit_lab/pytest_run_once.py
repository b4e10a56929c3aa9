"""pytest plugin: a test that passed in one run of ``scripts/test`` is not run again in the next.

``scripts/test`` first runs each package's tests in an environment holding only that package
(``scripts/test-isolated``), then the whole suite in the workspace. ``--record-passed FILE``
writes the node id of every test that passed (setup, call and teardown) to ``FILE``;
``--skip-passed DIR`` deselects, in a later run, every test whose node id a file in ``DIR``
lists. So each test runs once: in its package's own environment where it can (the stricter
check: no dependency it does not declare), in the workspace otherwise (one that skipped in
isolation, for example for want of Ray, runs there). Loaded by the repository's root
``conftest.py``; works under pytest-xdist (the controller records, every worker deselects
the same items).
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["passed_elsewhere"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("refit run once")
    group.addoption(
        "--record-passed",
        metavar="FILE",
        help="write the node id of each test that passed to FILE (one per line, replaced)",
    )
    group.addoption(
        "--skip-passed",
        metavar="DIR",
        help="deselect the tests listed in the files of DIR (written by --record-passed)",
    )


def passed_elsewhere(folder: Path) -> frozenset[str]:
    """The node ids the files in ``folder`` list (an absent folder lists none)."""
    if not folder.is_dir():
        return frozenset()
    return frozenset(
        line
        for path in sorted(folder.iterdir())
        if path.is_file()
        for line in path.read_text().splitlines()
        if line
    )


class _PassedRecorder:
    """Appends a test's node id to a file once its teardown passed after a passed setup and
    call (a skipped or expected-to-fail test is no pass)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self._path = path
        self._not_passed: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed or report.skipped:
            self._not_passed.add(report.nodeid)
        elif report.when == "teardown" and report.nodeid not in self._not_passed:
            with self._path.open("a") as out:
                out.write(report.nodeid + "\n")


def pytest_configure(config: pytest.Config) -> None:
    record = config.getoption("--record-passed")
    if record and not hasattr(config, "workerinput"):  # the xdist controller or a plain run
        config.pluginmanager.register(_PassedRecorder(Path(record)), "refit-passed-recorder")


def pytest_report_header(config: pytest.Config) -> str | None:
    """How many tests an earlier run passed (each worker deselects them; under xdist the
    controller's summary counts no deselection)."""
    folder = config.getoption("--skip-passed")
    if not folder:
        return None
    return (
        f"run once: {len(passed_elsewhere(Path(folder)))} tests passed in {folder}, not run again"
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    folder = config.getoption("--skip-passed")
    if not folder:
        return
    done = passed_elsewhere(Path(folder))
    if done.isdisjoint(item.nodeid for item in items):
        return
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = [item for item in items if item.nodeid not in done]
