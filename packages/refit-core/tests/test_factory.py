"""Validation order and error paths of ``create_weight_synchronizer``."""

from __future__ import annotations

import math
import re

import pytest

from refit_core import BackendNotInstalledError, create_weight_synchronizer
from refit_core.registry import KNOWN_ROWS, BackendRow, find_row, load_builder, row_status

CLUSTERS = {"train_cluster": object(), "inference_cluster": object()}


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


@pytest.mark.parametrize("missing", ["train_cluster", "inference_cluster"])
def test_non_colocated_needs_both_clusters(missing: str) -> None:
    clusters = {k: v for k, v in CLUSTERS.items() if k != missing}
    with pytest.raises(ValueError, match="needs both train_cluster and inference_cluster"):
        create(generation_backend="vllm", colocated=False, **clusters)


def test_sglang_non_colocated_works_without_clusters() -> None:
    # Gets past cluster validation: what remains is the row's own availability.
    with pytest.raises((NotImplementedError, BackendNotInstalledError, AssertionError)) as info:
        create(generation_backend="sglang", colocated=False)
    assert "train_cluster" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "1", True])
@pytest.mark.parametrize("field", ["refit_buffer_size_gb", "refit_timeout_s"])
def test_scalar_arguments_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        create(generation_backend="vllm", colocated=True, **{field: value})


def test_colocated_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="colocated must be a bool"):
        create(generation_backend="vllm", colocated="yes")


def test_default_transport_per_topology() -> None:
    assert find_row("vllm", True, None).transport == "ipc"
    assert find_row("vllm", False, None).transport == "collective"
    assert find_row("vllm", False, "zmq_sparse").package == "refit-zmq"
    assert find_row("sglang", True, None).transport == "ray_ipc"
    assert find_row("dynamo", False, None).package == "refit-dynamo"


def test_every_row_has_unique_key_and_hint() -> None:
    keys = [r.key for r in KNOWN_ROWS]
    assert len(keys) == len(set(keys))
    for row in KNOWN_ROWS:
        assert row.install_hint == f'pip install "refit-core[{row.extra}]"'


def test_missing_package_raises_with_install_hint() -> None:
    row = BackendRow("vllm", "colocated", "ipc", "refit-not-a-real-package", "vllm", "test row")
    with pytest.raises(BackendNotInstalledError) as info:
        load_builder(row)
    assert info.value.install_hint == 'pip install "refit-core[vllm]"'
    assert 'pip install "refit-core[vllm]"' in str(info.value)
    assert isinstance(info.value, ImportError)
    assert not row_status(row).installed


def test_unimplemented_row_says_so() -> None:
    unimplemented = [
        r for r in KNOWN_ROWS if row_status(r).installed and not row_status(r).implemented
    ]
    if not unimplemented:
        pytest.skip("every installed row is implemented")
    row = unimplemented[0]
    kwargs: dict[str, object] = dict(CLUSTERS) if row.topology == "non-colocated" else {}
    with pytest.raises(NotImplementedError, match="not implemented by"):
        create(
            generation_backend=row.backend,
            colocated=row.topology == "colocated",
            transport=row.transport,
            **kwargs,
        )


def test_uninstalled_row_names_its_install_line() -> None:
    missing = [r for r in KNOWN_ROWS if not row_status(r).installed]
    if not missing:
        pytest.skip("every backend package is installed in this environment")
    row = missing[0]
    kwargs: dict[str, object] = dict(CLUSTERS) if row.topology == "non-colocated" else {}
    with pytest.raises(BackendNotInstalledError, match=re.escape(row.install_hint)):
        create(
            generation_backend=row.backend,
            colocated=row.topology == "colocated",
            transport=row.transport,
            **kwargs,
        )
