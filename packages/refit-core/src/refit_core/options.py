"""Options checked when they are built: every field of a dataclass against its annotation.

A row's options object (what ``create_weight_synchronizer(..., options=...)`` takes) calls
:func:`check_field_types` in its ``__post_init__``, so a field of the wrong type is refused
where the options are written, not at the first refit.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

__all__ = ["check_field_types"]


def check_field_types(options: object) -> None:
    """Refuse a field of the dataclass instance ``options`` whose value does not match its
    annotation: classes (an ``int`` passes for ``float``, a ``bool`` for neither), ``X | None``
    and other unions, ``Literal[...]``, ``tuple[X, ...]``, ``Any``; a generic checks its
    origin only.

    Raises:
        TypeError: naming the class, the field, the type it takes and the value it got.
    """
    hints = typing.get_type_hints(type(options))
    for field in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, field.name)
        expected = hints[field.name]
        if not _matches(value, expected):
            raise TypeError(
                f"{type(options).__name__}.{field.name} takes {_describe(expected)}, "
                f"got {value!r} ({type(value).__name__})"
            )


def _matches(value: object, expected: Any) -> bool:
    if expected is Any:
        return True
    origin = typing.get_origin(expected)
    arguments = typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, argument) for argument in arguments)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in arguments)
    if expected is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return all(_matches(item, arguments[0]) for item in value)
        return len(value) == len(arguments) and all(
            _matches(item, argument) for item, argument in zip(value, arguments, strict=True)
        )
    if origin is not None:
        return isinstance(value, origin)
    if expected is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    if isinstance(expected, type):
        return expected.__name__
    return str(expected).replace("typing.", "")
