"""Options are checked where they are built: a wrong type or a bucket under 1 MiB fails there,
before any engine is asked, not at the first refit (or inside a worker)."""

from __future__ import annotations

import pytest

from refit_nccl import CollectiveOptions
from refit_nccl.vllm import VllmCollectiveGeneration


@pytest.mark.parametrize(
    ("fields", "error", "says"),
    [
        ({"grace_s": "5"}, TypeError, r"CollectiveOptions.grace_s takes float, got '5'"),
        ({"backend": "mpi"}, TypeError, r"CollectiveOptions.backend takes .*'gloo', 'nccl'"),
        ({"buffer_size_bytes": 32768}, ValueError, r"buffer_size_bytes must be >= 1048576"),
    ],
)
def test_collective_options_refuse_a_bad_field(
    fields: dict[str, object], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        CollectiveOptions(**fields)  # type: ignore[arg-type]
    assert CollectiveOptions(grace_s=5, buffer_size_bytes=1 << 20).grace_s == 5


class _NeverAsked:
    """An engine that fails the test if the generation asks it anything."""

    def collective_rpc(self, *args: object) -> object:
        raise AssertionError("the engine was asked before the options were checked")


def test_vllm_generation_checks_its_bucket_size_before_asking_an_engine() -> None:
    with pytest.raises(
        ValueError, match=r"buffer_size_bytes must be >= 1048576 \(1 MiB\), got 32768"
    ):
        VllmCollectiveGeneration([_NeverAsked()], buffer_size_bytes=32768)
