"""One rule, one error for a refit's timeout at every public entry point.

Each way a user gives a refit its ``refit_timeout_s`` (the factory, every row's synchronizer
built directly, ``Deadline.after`` for a backend author) refuses a value that is not None or
a positive finite number with :class:`refit_core.InvalidTimeoutError` and one message shape,
before it looks at any other argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from refit_core import InvalidTimeoutError, WeightSynchronizer, create_weight_synchronizer
from refit_core.backend import Deadline
from refit_nccl import CollectiveWeightSynchronizer
from refit_nccl.megatron import MegatronWeightSynchronizer
from refit_sglang import ColocatedSGLangSynchronizer, SGLangCollectiveSynchronizer
from refit_zmq.ipc import IpcWeightSynchronizer
from refit_zmq.lora import LoraWeightSynchronizer
from refit_zmq.sparse import ZmqSparseWeightSynchronizer

SYNCHRONIZERS: list[type[WeightSynchronizer]] = [
    CollectiveWeightSynchronizer,
    ColocatedSGLangSynchronizer,
    IpcWeightSynchronizer,
    LoraWeightSynchronizer,
    MegatronWeightSynchronizer,
    SGLangCollectiveSynchronizer,
    ZmqSparseWeightSynchronizer,
]
BAD: list[Any] = [0, -2.5, float("nan"), float("inf"), True, "30"]


def _required_positionals(cls: type) -> int:
    """How many positional arguments ``cls`` needs (through a parent's, for ``*args``)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    own = sum(
        p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in params
    )
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        own += _required_positionals(cls.__mro__[1])
    return own


def _direct(cls: type[WeightSynchronizer]) -> Callable[[Any], object]:
    """Build ``cls`` with ``refit_timeout_s`` and None for every other required argument
    (the timeout is checked first, so none of them is looked at)."""
    count = _required_positionals(cls)
    return lambda timeout_s: cls(*[None] * count, refit_timeout_s=timeout_s)


ENTRY_POINTS: dict[str, Callable[[Any], object]] = {
    "create_weight_synchronizer": lambda timeout_s: create_weight_synchronizer(
        None, None, "vllm", True, refit_timeout_s=timeout_s
    ),
    "Deadline.after": lambda timeout_s: Deadline.after(timeout_s, name="refit_timeout_s"),
    **{cls.__name__: _direct(cls) for cls in SYNCHRONIZERS},
}


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_bad_timeout_alike(entry: str, bad: Any) -> None:
    with pytest.raises(InvalidTimeoutError) as raised:
        ENTRY_POINTS[entry](bad)
    assert str(raised.value) == (
        f"refit_timeout_s must be None or a positive finite number of seconds, got {bad!r}"
    )
