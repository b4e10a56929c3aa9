"""Facades whose names are imported on first use, so a package's rows can be read (and its
version asked) without importing torch or an HTTP client."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

__all__ = ["lazy_facade"]


def lazy_facade(package: str, modules: Sequence[str]) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) for the facade ``package``: the first access of a
    name in its ``__all__`` imports ``modules`` and binds every name of ``__all__`` they
    define, as an eager facade would have. Type checkers see the names through imports under
    ``if TYPE_CHECKING:``; assign the result under ``else:``."""

    def load(name: str) -> object:
        facade = sys.modules[package]
        exported: Sequence[str] = getattr(facade, "__all__", ())
        if name not in exported:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = [importlib.import_module(module) for module in modules]
        for wanted in exported:
            if wanted in vars(facade):
                continue
            for module in imported:
                if hasattr(module, wanted):
                    setattr(facade, wanted, getattr(module, wanted))
                    break
        if name not in vars(facade):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return vars(facade)[name]

    return load
