"""refit-sglang."""

__version__ = "0.1.0"
