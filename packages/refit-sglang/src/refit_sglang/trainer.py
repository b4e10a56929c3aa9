"""Trainer rank 0 of a disaggregated SGLang refit: hosts the weight-update group and
broadcasts each tensor of each bucket while the engines receive it."""

from __future__ import annotations

import logging
import threading
import time

from refit_core import CollectiveSenderSpec, Deadline, ProtocolError, RefitAbortedError
from refit_core.protocols import PolicyLike
from refit_nccl import AbortableProcessGroup, JoinRequest, TransferStats
from refit_sglang.plan import DistributedPlan, StateItems

__all__ = ["SGLangPeerTrainer"]

logger = logging.getLogger(__name__)


class SGLangPeerTrainer:
    """The sending trainer rank (rank 0) of a refit into SGLang engines.

    Serves the trainer calls of refit-nccl's synchronizer: ``refit_state``, ``refit_plan``,
    ``refit_join``, ``refit_transfer``, ``refit_abort``. Every group call runs under the
    remaining deadline, so this side never hangs.

    Args:
        policy: where the weights come from; ``weight_source()`` is read on every refit.
    """

    def __init__(self, policy: PolicyLike) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self._group: AbortableProcessGroup | None = None
        self._plan: DistributedPlan | None = None

    def refit_state(self) -> StateItems:
        """The state this trainer sends, in transfer order."""
        return tuple(self._policy.weight_source().state_dict_info().items())

    def refit_plan(self, state: StateItems, geometry: CollectiveSenderSpec) -> str:
        """The digest of the plan for ``state`` and ``geometry``."""
        return DistributedPlan.build(state, geometry).digest

    def refit_join(self, request: JoinRequest) -> str:
        """Leave any previous group, host ``request.group`` (the engines join it through
        ``init_weights_update_group``); the plan digest."""
        if request.group.rank != 0:
            raise ValueError("an SGLang refit has one trainer rank, the sender (rank 0)")
        with self._lock:
            if self._group is not None:
                self._group.abort("joining a new group")
            plan = DistributedPlan.build(request.state, request.geometry)
            self._group, self._plan = AbortableProcessGroup(request.group), None
            self._group.connect(Deadline.after(request.timeout_s))
            self._plan = plan
            return plan.digest

    def refit_transfer(self, version: int, timeout_s: float | None) -> TransferStats:
        """Broadcast every tensor, bucket by bucket, in plan order."""
        with self._lock:
            group, plan = self._group, self._plan
            if group is None or plan is None:
                raise RefitAbortedError("not in a group: call refit_join first")
            deadline = Deadline.after(timeout_s)
            started = time.monotonic()
            tensors = iter(self._policy.weight_source().iter_tensors())
            for bucket in plan.buckets:
                for name, _ in bucket:
                    sent = next(tensors, None)
                    if sent is None or sent.name != name:
                        raise ProtocolError(
                            f"the source yielded {sent and sent.name!r}, plan {name!r}"
                        )
                    tensor = sent.tensor.to(group.device, non_blocking=False).contiguous()
                    group.broadcast(tensor, 0, deadline)
            elapsed = time.monotonic() - started
            logger.info(
                "sent version %d (%d buckets) in %.3f s", version, len(plan.buckets), elapsed
            )
            return TransferStats(
                len(plan.buckets), plan.dense_bytes, plan.dense_bytes, 0.0, 0.0, elapsed, elapsed
            )

    def refit_abort(self, cause: str, group_name: str | None = None) -> None:
        """Abort the current group (only if it is ``group_name``, when given); never blocks."""
        group = self._group
        if group is not None and group_name in (None, group.spec.name):
            group.abort(cause)
