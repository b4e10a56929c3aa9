"""The child-process group (:class:`ChildProcessGroup`), and :func:`make_group`, which picks
it or the in-process group as a spec asks."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from torch._C._distributed_c10d import TCPStore

from refit_core.backend import Deadline
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.child.communicator import ChildCommunicator
from refit_nccl.group.child.messages import CONNECT_ID
from refit_nccl.group.spec import GroupSpec
from refit_nccl.group.traits import Communicator

__all__ = ["ChildProcessGroup", "make_group"]

_CHILD_MAIN = "import sys; from refit_nccl.group.child.serve import serve; serve(int(sys.argv[1]))"


class ChildProcessGroup(AbortableProcessGroup):
    """An :class:`AbortableProcessGroup` whose communicator runs in a spawned child.

    Same API, rendezvous and warm-up (run by the child); every call is bounded by its
    deadline in the parent, and abort (or a call past its deadline) SIGKILLs the child, so no
    call outlives its deadline whatever the backend does. CPU tensors (gloo) only.
    """

    def __init__(self, spec: GroupSpec) -> None:
        super().__init__(dataclasses.replace(spec, in_child=True))
        # The parent bounds every wait itself; killing the child is what releases it.
        self._lifecycle.traits = dataclasses.replace(
            self._lifecycle.known_traits,
            per_call_timeout=True,
            abort_releases=False,
            waits_in_slices=False,
        )

    def _open(self, deadline: Deadline) -> tuple[Communicator, TCPStore | None]:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
            )
        conn = Connection(ours.detach())
        comm = ChildCommunicator(process, conn, self.spec.label, self.spec.rank)
        try:
            comm.send_message((self.spec, deadline.to_wire()))
            timeout = self._calls.timeout(deadline, "rendezvous")
            comm.await_reply(CONNECT_ID, timeout.total_seconds())
        except BaseException:
            comm.abort()
            raise
        return comm, None

    def _warm_up(self, deadline: Deadline) -> None:
        """The child's group warmed up when it connected."""


def make_group(spec: GroupSpec) -> AbortableProcessGroup:
    """The group ``spec`` asks for: in a child process if ``spec.in_child``, else in this one."""
    return ChildProcessGroup(spec) if spec.in_child else AbortableProcessGroup(spec)
