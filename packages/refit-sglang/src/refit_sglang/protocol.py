"""SGLang's request bodies for the routes refit uses, as read from SGLang's source.

Read from ``python/sglang/srt/managers/io_struct.py`` of sgl-project/sglang at commit
``001067fffe33427bee0ed2f007fb7551a1d76b44`` (the ``*ReqInput`` msgspec structs; every one
also inherits ``rid`` from ``BaseReq``), with the routes of
``python/sglang/srt/entrypoints/http_server.py`` (``POST /<name>``, answering
``{"success": bool, "message": str}`` with status 200 or 400). :func:`validate_request` is
stricter than SGLang: it also refuses unknown fields, so a misspelt optional field (which
SGLang would silently ignore) fails a test instead of being dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "PAUSE_MODES",
    "REFIT_FIELDS",
    "REQUESTS",
    "SGLANG_COMMIT",
    "TOKENIZER_CALLS",
    "Field",
    "RequestSchemaError",
    "TokenizerCall",
    "validate_request",
]

SGLANG_COMMIT: Final = "001067fffe33427bee0ed2f007fb7551a1d76b44"
"""The sgl-project/sglang commit the request fields were read from."""

PAUSE_MODES: Final = ("abort", "retract", "in_place")
"""``PauseGenerationReqInput.mode``'s literal values."""


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_float(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


def _list_of(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, list) and all(check(v) for v in value)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _is_bytes_or_b64(value: object) -> bool:
    return isinstance(value, bytes | str)


@dataclass(frozen=True)
class Field:
    """One field of a request struct: its SGLang type (as text), check, and whether required."""

    type_name: str
    check: Callable[[object], bool]
    required: bool = False


_RID = Field(
    "Optional[Union[str, List[str]]]", _optional(lambda v: _is_str(v) or _list_of(_is_str)(v))
)

REQUESTS: Final[Mapping[str, Mapping[str, Field]]] = {
    "pause_generation": {
        "mode": Field('Literal["abort", "retract", "in_place"]', lambda v: v in PAUSE_MODES),
    },
    "continue_generation": {"torch_empty_cache": Field("bool", _is_bool)},
    "flush_cache": {"timeout_s": Field("Optional[float]", _optional(_is_float))},
    "update_weights_from_tensor": {
        "serialized_named_tensors": Field("List[bytes]", _list_of(_is_bytes_or_b64), True),
        "load_format": Field("Optional[str]", _optional(_is_str)),
        "flush_cache": Field("bool", _is_bool),
        "abort_all_requests": Field("bool", _is_bool),
        "weight_version": Field("Optional[str]", _optional(_is_str)),
        "disable_draft_model": Field("Optional[bool]", _optional(_is_bool)),
        "torch_empty_cache": Field("bool", _is_bool),
    },
    "update_weights_from_distributed": {
        "names": Field("List[str]", _list_of(_is_str), True),
        "dtypes": Field("List[str]", _list_of(_is_str), True),
        "shapes": Field("List[List[int]]", _list_of(_list_of(_is_int)), True),
        "group_name": Field("str", _is_str),
        "flush_cache": Field("bool", _is_bool),
        "abort_all_requests": Field("bool", _is_bool),
        "weight_version": Field("Optional[str]", _optional(_is_str)),
        "load_format": Field("Optional[str]", _optional(_is_str)),
        "torch_empty_cache": Field("bool", _is_bool),
    },
    "init_weights_update_group": {
        "master_address": Field("str", _is_str, True),
        "master_port": Field("int", _is_int, True),
        "rank_offset": Field("int", _is_int, True),
        "world_size": Field("int", _is_int, True),
        "group_name": Field("str", _is_str),
        "backend": Field("str", _is_str),
    },
    "destroy_weights_update_group": {"group_name": Field("str", _is_str)},
}
"""Route name -> field name -> :class:`Field` (``rid`` is accepted on every route)."""

REFIT_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "pause_generation": ("mode",),
    "continue_generation": (),
    "flush_cache": (),
    "update_weights_from_tensor": (
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "weight_version",
    ),
    "update_weights_from_distributed": (
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "weight_version",
    ),
    "init_weights_update_group": (
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    ),
    "destroy_weights_update_group": ("group_name",),
}
"""The fields refit sets on each route (a subset of :data:`REQUESTS`): an in-process engine
must accept every one of them, or refit refuses it before anything moves."""


@dataclass(frozen=True)
class TokenizerCall:
    """How SGLang's ``TokenizerManager`` serves a route in process.

    Attributes:
        request_type: the ``io_struct`` class the fields travel in; None where the coroutine
            takes them as keywords (``flush_cache(timeout_s=None)``).
        request_slot: whether the coroutine also takes the HTTP request after the struct
            (``sglang.Engine`` passes ``None`` there).
    """

    request_type: str | None
    request_slot: bool


TOKENIZER_CALLS: Final[Mapping[str, TokenizerCall]] = {
    "pause_generation": TokenizerCall("PauseGenerationReqInput", request_slot=False),
    "continue_generation": TokenizerCall("ContinueGenerationReqInput", request_slot=False),
    "flush_cache": TokenizerCall(None, request_slot=False),
    "update_weights_from_tensor": TokenizerCall(
        "UpdateWeightsFromTensorReqInput", request_slot=True
    ),
    "update_weights_from_distributed": TokenizerCall(
        "UpdateWeightsFromDistributedReqInput", request_slot=True
    ),
    "init_weights_update_group": TokenizerCall("InitWeightsUpdateGroupReqInput", request_slot=True),
    "destroy_weights_update_group": TokenizerCall(
        "DestroyWeightsUpdateGroupReqInput", request_slot=True
    ),
}
"""Route -> its ``TokenizerManager`` coroutine (same name). Read at commit
:data:`SGLANG_COMMIT`: ``pause_generation(obj)`` and ``continue_generation(obj)`` in
``managers/tokenizer_manager.py``; the calls ``sglang.Engine`` makes in
``entrypoints/engine.py`` (``flush_cache()``, ``<route>(obj, None)`` for the weight routes)."""


class RequestSchemaError(ValueError):
    """A request body that SGLang's request struct would not accept (or would misread)."""


def validate_request(route: str, body: Mapping[str, object]) -> None:
    """Check ``body`` against the fields of ``route``'s SGLang request struct.

    Raises:
        RequestSchemaError: an unknown route, an unknown field, a missing required field,
            or a value of the wrong type.
    """
    fields = REQUESTS.get(route)
    if fields is None:
        raise RequestSchemaError(f"SGLang has no refit route {route!r}")
    problems = [f"unknown field {k!r}" for k in body if k not in fields and k != "rid"]
    problems += [f"missing field {k!r}" for k, f in fields.items() if f.required and k not in body]
    for key, value in body.items():
        field = _RID if key == "rid" else fields.get(key)
        if field is not None and not field.check(value):
            problems.append(f"{key!r} must be {field.type_name}, got {type(value).__name__}")
    if problems:
        raise RequestSchemaError(f"{route}: {'; '.join(problems)} (SGLang {SGLANG_COMMIT[:12]})")
