"""The (vllm, colocated, ``ipc``) row: tensor handles over ZMQ control sockets.

Trainer side: :class:`IpcWeightSynchronizer` (built by the factory through
:func:`build_ipc_synchronizer`). Worker side: :class:`IpcReceiver` around any
:class:`IpcEngine`. Modules, one job each:

- :mod:`.protocol`: the JSON control messages and error codes;
- :mod:`.sizing`: slot alignment and the default buffer size;
- :mod:`.shm`, :mod:`.cuda_ipc`, :mod:`.handles`: shared buffers and their handles;
- :mod:`.packing`: the ping-pong buffers and the packer (trainer side);
- :mod:`.links`: the control sockets with deadlines (trainer side);
- :mod:`.transaction`: manifest checks (worker side);
- :mod:`.receiver`: :class:`IpcReceiver`;
- :mod:`.synchronizer`, :mod:`.builder`: the synchronizer and the factory's builder.
"""

from refit_zmq.ipc.builder import IpcGeneration, build_ipc_synchronizer
from refit_zmq.ipc.links import WorkerLinks
from refit_zmq.ipc.receiver import IpcEngine, IpcReceiver
from refit_zmq.ipc.synchronizer import IpcOptions, IpcWeightSynchronizer

__all__ = [
    "IpcEngine",
    "IpcGeneration",
    "IpcOptions",
    "IpcReceiver",
    "IpcWeightSynchronizer",
    "WorkerLinks",
    "build_ipc_synchronizer",
]
