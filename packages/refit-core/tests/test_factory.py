"""Validation order and error paths of ``create_weight_synchronizer``."""

from __future__ import annotations

import math
import re

import pytest

from refit_core import BackendNotInstalledError, create_weight_synchronizer
from refit_core.known_rows import KNOWN_ROWS, KnownRow
from refit_core.registry import discover, find_row

CLUSTERS = {"train_cluster": object(), "inference_cluster": object()}
INSTALLED = {r.row.key for r in discover().rows}
MISSING = [r for r in KNOWN_ROWS if r.key not in INSTALLED]
PRESENT = [r for r in KNOWN_ROWS if r.key in INSTALLED]


class Untouchable:
    """A policy/generation that fails the test if the factory looks at it early."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"factory inspected {name!r} before validating its arguments")


def create(**kwargs: object) -> object:
    return create_weight_synchronizer(Untouchable(), Untouchable(), **kwargs)  # type: ignore[arg-type]


def test_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="unknown generation_backend 'trt'.*vllm.*sglang.*megatron.*dynamo"
    ):
        create(generation_backend="trt", colocated=True)


def test_unknown_transport_names_the_row_transports() -> None:
    with pytest.raises(
        ValueError, match="unknown transport 'carrier-pigeon'.*'collective'.*'zmq_sparse'"
    ):
        create(generation_backend="vllm", colocated=False, transport="carrier-pigeon", **CLUSTERS)


def test_transport_of_another_topology_is_refused() -> None:
    with pytest.raises(ValueError, match="'ipc'"):
        create(generation_backend="vllm", colocated=True, transport="zmq_sparse")


def test_colocated_dynamo_is_not_supported() -> None:
    with pytest.raises(NotImplementedError, match="dynamo colocated"):
        create(generation_backend="dynamo", colocated=True)


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "1", True])
@pytest.mark.parametrize("field", ["refit_buffer_size_gb", "refit_timeout_s"])
def test_scalar_arguments_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        create(generation_backend="vllm", colocated=True, **{field: value})


def test_colocated_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="colocated must be a bool"):
        create(generation_backend="vllm", colocated="yes")


def test_every_known_row_has_unique_key_and_hint() -> None:
    keys = [r.key for r in KNOWN_ROWS]
    assert len(keys) == len(set(keys))
    for row in KNOWN_ROWS:
        assert row.install_hint == f'pip install "refit-core[{row.extra}]"'
    defaults = [(r.backend, r.topology) for r in KNOWN_ROWS if r.default]
    assert len(defaults) == len(set(defaults))


@pytest.mark.parametrize("row", [pytest.param(r, id=r.key) for r in MISSING])
def test_uninstalled_row_names_its_install_line(row: KnownRow) -> None:
    with pytest.raises(BackendNotInstalledError, match=re.escape(row.install_hint)) as info:
        find_row(row.backend, row.topology == "colocated", row.transport)
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize("row", [pytest.param(r, id=r.key) for r in PRESENT])
def test_installed_rows_agree_with_core_hints(row: KnownRow) -> None:
    installed = find_row(row.backend, row.topology == "colocated", row.transport)
    assert installed.distribution == row.package
    assert installed.row.default == row.default
    if row.default:
        assert find_row(row.backend, row.topology == "colocated", None) == installed
