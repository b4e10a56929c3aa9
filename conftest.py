"""Repository-wide pytest configuration: the refit markers plugin, run-once across isolated and
workspace runs (scripts/test), and ``--run-long``."""

import pytest

pytest_plugins = ["refit_lab.pytest_plugin", "refit_lab.pytest_run_once"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-long",
        action="store_true",
        default=False,
        help="run the tests marked long (many minutes each), skipped otherwise",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-long"):
        return
    skip = pytest.mark.skip(reason="a long run: pass --run-long")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)
