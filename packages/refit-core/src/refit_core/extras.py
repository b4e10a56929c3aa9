"""refit-core's extras: the pip line that installs one, and the error of a module whose
extra is missing.

refit-core itself depends on nothing. A module that imports a third-party package at load
(the vLLM worker helpers: torch, xxhash) turns its ``ModuleNotFoundError`` into
:func:`missing_extra`'s error, which names the extra that installs the package.
"""

from __future__ import annotations

__all__ = ["install_hint", "missing_extra"]


def install_hint(extra: str) -> str:
    """The pip line that installs refit-core with ``extra``."""
    return f'pip install "refit-core[{extra}]"'


def missing_extra(module: str, missing: ModuleNotFoundError, extra: str) -> ImportError:
    """The error of importing ``module``, which needs the package ``missing`` did not find:
    an ``ImportError`` naming that package and the line that installs ``extra``."""
    return ImportError(
        f"{module} needs {missing.name}, which is not installed; install it with: "
        f"{install_hint(extra)}",
        name=missing.name,
    )
