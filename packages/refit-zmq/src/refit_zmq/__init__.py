"""refit-zmq: the sparse delta codec, the ZeroMQ relay tree and the colocated IPC channel.

Users import the part they deploy: :mod:`refit_zmq.vllm` (vLLM engines and their receivers),
:mod:`refit_zmq.sparse` (a relay beside a custom engine, the sparse row's options),
:mod:`refit_zmq.ipc` (the colocated channel and its options); the components themselves are
:mod:`refit_zmq.relay`, :mod:`refit_zmq.codec` and :mod:`refit_zmq.tracker`.
"""

from importlib import metadata

__version__ = metadata.version("refit-zmq")

__all__ = ["__version__"]
