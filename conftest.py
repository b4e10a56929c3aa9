"""Repository-wide pytest configuration: the refit markers plugin."""

pytest_plugins = ["refit_lab.pytest_plugin"]
