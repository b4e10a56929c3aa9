"""A process group whose communicator runs in a child process that is killed on abort.

The fallback for a communicator whose calls neither take a timeout nor end when it is aborted
(the design torchft uses): the child (:mod:`~refit_nccl.group.child.serve`) owns the real
communicator (an :class:`~refit_nccl.group.abortable.AbortableProcessGroup`: same rendezvous,
same warm-up) and runs the calls the parent sends over a socket pair
(:mod:`~refit_nccl.group.child.messages`); tensors travel through shared-memory buffers
(:mod:`~refit_nccl.group.child.buffers`: files in ``/dev/shm`` that both map, unlinked once the
child has them) registered with the child once: one copy in before a call, one copy out after
it. The parent (:mod:`~refit_nccl.group.child.communicator`) waits for each reply at most until
the call's deadline; past it, or on abort, it SIGKILLs the child, which ends every call in it
whatever the backend does. A group is connected once, so the next rendezvous (a reconcile)
starts a fresh child (:class:`~refit_nccl.group.child.process_group.ChildProcessGroup`). The
child is a plain subprocess of the same interpreter (not a multiprocessing child), so daemonic
processes can use it too; it exits when the parent goes away (its end of the socket closes).

CPU tensors only (gloo): a CUDA communicator in a child would need CUDA IPC handles.
"""
