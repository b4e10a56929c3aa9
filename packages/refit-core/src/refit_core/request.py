"""What a row's builder receives: everything ``create_weight_synchronizer`` was given, checked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["SynchronizerRequest"]

_O = TypeVar("_O")
_D = TypeVar("_D", bound="DataclassInstance")

GIB_BYTES = 1024**3


@dataclass(frozen=True)
class SynchronizerRequest:
    """Everything ``create_weight_synchronizer`` was given, validated, with the row resolved.

    Attributes:
        refit_buffer_size_gb: bucket (or payload) size in GiB (2**30 bytes), or None for the
            row's default; :attr:`refit_buffer_size_bytes` gives it in bytes.
        options: the row's own options object (of the type its row declares), or None.
    """

    policy: Any
    generation: Any
    generation_backend: str
    colocated: bool
    transport: str
    train_cluster: Any = None
    inference_cluster: Any = None
    refit_buffer_size_gb: float | None = None
    refit_timeout_s: float | None = None
    options: object = None

    @property
    def refit_buffer_size_bytes(self) -> int | None:
        """``refit_buffer_size_gb`` in bytes (GiB), or None when unset."""
        if self.refit_buffer_size_gb is None:
            return None
        return int(self.refit_buffer_size_gb * GIB_BYTES)

    def with_buffer_size(self, options: _D, field_name: str) -> _D:
        """``options`` (a dataclass) with its size field ``field_name`` set from
        ``refit_buffer_size_gb`` when that is given.

        Raises:
            ValueError: the options set that field to another value than its default and than
                ``refit_buffer_size_gb``.
        """
        asked = self.refit_buffer_size_bytes
        if asked is None:
            return options
        default = next(f.default for f in dataclasses.fields(options) if f.name == field_name)
        configured = getattr(options, field_name)
        if configured not in (default, asked):
            raise ValueError(
                f"refit_buffer_size_gb={self.refit_buffer_size_gb} GiB ({asked} B) and "
                f"options.{field_name}={configured} B disagree; set one of them"
            )
        return dataclasses.replace(options, **{field_name: asked})

    def options_as(self, kind: type[_O]) -> _O | None:
        """The options, typed as the row's options class (None when none were given).

        Raises:
            ValueError: options of another type (a builder called without the factory).
        """
        if self.options is None:
            return None
        if not isinstance(self.options, kind):
            raise ValueError(
                f"options of {self.generation_backend} {self.transport} must be a "
                f"{kind.__name__}, got {type(self.options).__name__}"
            )
        return self.options
