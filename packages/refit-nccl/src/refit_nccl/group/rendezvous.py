"""How a group's members meet: the store keys and the warm-up each convention expects.

Three conventions, chosen by ``GroupSpec.rendezvous``:

* ``"refit"``: the communicator's store keys live under the group's name, and the warm-up
  all-reduce sums a one from every rank, so it also checks the world size.
* ``"vllm"``: what a vLLM peer expects (read in vLLM 0.32.0,
  ``vllm/distributed/utils.py``): rank 0 hosts the TCPStore on the given port and every
  rank is a client of it (``StatelessProcessGroup.create``); a torch communicator built
  by ``stateless_init_torch_distributed_process_group`` keeps its keys under
  ``tcp://host:port`` (``[host]`` for IPv6, ``vllm.utils.network_utils.get_tcp_uri``); the
  warm-up is the one-element all-reduce of a float32 zero that ``PyNcclCommunicator`` issues
  right after it joins (``vllm/distributed/device_communicators/pynccl.py``), which every
  foreign peer must match before any other collective. vLLM's weight-transfer receiver runs
  no plan handshake: it cuts buckets from the update info by its packing rule
  (:data:`refit_nccl.transfer.plan.PACKING_RULES` ``["vllm"]``).

* ``"sglang"``: what SGLang's weight-update group expects (read in SGLang 0.5.23,
  ``sglang/srt/utils/common.py`` ``init_custom_process_group``, and torch's
  ``_new_process_group_helper``): SGLang wraps the store in ``PrefixStore(group_name)``, torch
  adds ``PrefixStore(f"{group_name}/")`` and ``PrefixStore(f"{device}/")`` for the backend's
  first device (one communicator serves every device when they share a backend: gloo
  ``cpu``, NCCL ``cuda``). No warm-up: SGLang's first collective is the first broadcast of
  an update.

vLLM's NCCL receiver builds its communicator from an NCCL unique id that rank 0 pickles
under the store key ``broadcast_from/0/0``; on the ``nccl`` backend a ``"vllm"`` group is that
communicator, built by vLLM's own code (:mod:`refit_nccl.vllm_native`), on the raw store.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

__all__ = ["Convention", "ConventionName", "convention_of"]

ConventionName = Literal["refit", "vllm", "sglang"]
"""The name of a rendezvous convention (``GroupSpec.rendezvous``)."""


def _tcp_uri(host: str, port: int) -> str:
    try:
        bracket = ipaddress.ip_address(host).version == 6
    except ValueError:
        bracket = False
    return f"tcp://[{host}]:{port}" if bracket else f"tcp://{host}:{port}"


@dataclass(frozen=True)
class Convention:
    """The store keys and warm-up of one rendezvous convention.

    Attributes:
        name: the convention.
        warm_up_value: what each rank contributes to the warm-up all-reduce (sum); None
            where the convention has no warm-up.
        counts_ranks: whether the warm-up sum must equal the world size (else zero).
    """

    name: ConventionName
    warm_up_value: float | None
    counts_ranks: bool

    def store_prefix(self, group_name: str, host: str, port: int, backend: str | None) -> str:
        """The prefix of the communicator's store keys (``backend`` None: before the members
        agreed on one, which only refit's convention does)."""
        if self.name == "refit":
            return group_name
        if self.name == "vllm":
            return _tcp_uri(host, port)
        device = "cpu" if backend == "gloo" else "cuda"
        return f"{group_name}/{group_name}//{device}/"

    def expected_warm_up(self, world_size: int) -> float:
        """What the warm-up all-reduce sums to when every rank took part."""
        return float(world_size) if self.counts_ranks else 0.0


_CONVENTIONS: dict[str, Convention] = {
    "refit": Convention("refit", warm_up_value=1.0, counts_ranks=True),
    "vllm": Convention("vllm", warm_up_value=0.0, counts_ranks=False),
    "sglang": Convention("sglang", warm_up_value=None, counts_ranks=False),
}


def convention_of(rendezvous: str) -> Convention:
    """The convention called ``rendezvous``; ValueError for an unknown one."""
    try:
        return _CONVENTIONS[rendezvous]
    except KeyError:
        known = ", ".join(_CONVENTIONS)
        raise ValueError(f"unknown rendezvous {rendezvous!r}; known: {known}") from None
