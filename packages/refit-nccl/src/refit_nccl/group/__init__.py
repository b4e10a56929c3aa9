"""The abortable process group: its spec, backends, rendezvous conventions and device choice,
the calls that end by their deadline, the watchdog, and the variant whose communicator runs
in a child process that is killed on abort (``child``)."""
