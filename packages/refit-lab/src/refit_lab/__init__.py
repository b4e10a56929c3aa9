"""refit-lab: the reference engine, conformance suite, fault injection and local Ray cluster
every backend's tests use (one module each), and the benchmarks and demo (``refit-lab[bench]``).
Not for production installs."""

from importlib import metadata

__version__ = metadata.version("refit-lab")

__all__ = ["__version__"]
