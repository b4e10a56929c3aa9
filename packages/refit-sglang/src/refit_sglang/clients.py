"""The SGLang client for each item of a synchronizer's ``generation``, chosen by what it is."""

from __future__ import annotations

from collections.abc import Sequence

from refit_sglang.client import HttpClient, SGLangClient
from refit_sglang.engine_client import EngineClient

__all__ = ["clients_for"]


def _is_engine(item: object) -> bool:
    """``sglang.Engine`` (it has a ``tokenizer_manager``) or an Engine-like object."""
    return hasattr(item, "tokenizer_manager") or callable(
        getattr(item, "update_weights_from_tensor", None)
    )


def clients_for(generation: object) -> list[SGLangClient]:
    """SGLang clients for ``generation``: a base URL (:class:`HttpClient`), an
    ``SGLangClient``, an ``sglang.Engine`` or Engine-like object (:class:`EngineClient`), or
    a sequence of these.

    Raises:
        ValueError: ``generation`` is none of these, or an empty sequence.
        BackendNotInstalledError: an Engine needs SGLang's request structs and ``sglang``
            is not importable (pass ``EngineClient(engine, io_struct=...)`` instead).
    """
    items: Sequence[object] = (
        generation
        if isinstance(generation, Sequence) and not isinstance(generation, str)
        else [generation]
    )
    if not items:
        raise ValueError("generation names no SGLang engine")
    clients: list[SGLangClient] = []
    for index, item in enumerate(items):
        if isinstance(item, SGLangClient):
            clients.append(item)
        elif isinstance(item, str):
            clients.append(HttpClient(item))
        elif _is_engine(item):
            clients.append(EngineClient(item, f"engine {index}"))
        else:
            raise ValueError(
                "generation must be SGLang server URLs, sglang.Engine-like objects or "
                f"SGLangClients, got {type(item).__name__}"
            )
    return clients
