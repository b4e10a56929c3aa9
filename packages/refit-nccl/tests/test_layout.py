"""refit-nccl's modules keep names a reader cannot confuse (``backend`` beside ``backends``
was such a pair)."""

from __future__ import annotations

import itertools
from pathlib import Path

import refit_nccl

PACKAGE = Path(refit_nccl.__file__).parent


def one_letter_apart(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with one letter changed, added or removed."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def test_one_letter_apart() -> None:
    assert one_letter_apart("backend", "backends")
    assert one_letter_apart("state", "stats")
    assert not one_letter_apart("plan", "plan")
    assert not one_letter_apart("group", "groups_x")


def test_no_two_module_names_differ_by_one_letter() -> None:
    names = {
        path.parent.name if path.name == "__init__.py" else path.stem
        for path in PACKAGE.rglob("*.py")
    }
    pairs = [(a, b) for a, b in itertools.combinations(sorted(names), 2) if one_letter_apart(a, b)]
    assert not pairs
